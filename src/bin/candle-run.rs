//! `candle-run`: starts the ranks of a distributed program (torchrun's analogue).
//! See `candle-run --help` and `candle_parallel::launch`.

use candle_parallel::launch::{exit_code, launch, parse_args, Parsed, USAGE};

fn main() {
    // The launcher's and the library's messages go through `log`; RUST_LOG sets the level.
    candle_parallel::logging::init();
    let code = match parse_args(std::env::args_os().skip(1)) {
        Ok(Parsed::Help) => {
            println!("{USAGE}");
            0
        }
        Ok(Parsed::Version) => {
            println!("candle-run {}", env!("CARGO_PKG_VERSION"));
            0
        }
        Ok(Parsed::Run {
            config,
            program,
            args,
        }) => {
            if config.nnodes > 1
                && config.token.is_none()
                && std::env::var_os(candle_parallel::distributed::TOKEN_VAR).is_none()
            {
                eprintln!(
                    "candle-run: warning: CANDLE_PARALLEL_TOKEN is not set; set the same value on \
                     every machine so that the job refuses strangers"
                );
            }
            let result = launch(&config, &program, &args);
            if let Err(e) = &result {
                eprintln!("candle-run: {e}");
            }
            exit_code(&result)
        }
        Err(e) => {
            eprintln!("candle-run: {e} (see candle-run --help)");
            2
        }
    };
    std::process::exit(code);
}
