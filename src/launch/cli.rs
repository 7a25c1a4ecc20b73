//! `candle-run`'s command line: torchrun's options, then the program and its arguments.

use super::LaunchConfig;
use crate::error::{Error, Result};
use std::ffi::OsString;
use std::time::Duration;

/// `candle-run --help`.
pub const USAGE: &str = "\
candle-run: start the ranks of a candle-parallel (or torchrun-style) program

USAGE:
    candle-run [OPTIONS] [--] PROGRAM [ARGS...]

OPTIONS:
    --nproc-per-node N   ranks on this machine (a number, or `gpu` for one per GPU) [1]
    --nnodes M           machines in the job [1]
    --node-rank K        this machine's index in 0..M [0]
    --master-addr ADDR   address of the machine running rank 0 [127.0.0.1]
    --master-port PORT   port of rank 0's store [a free port; required when M > 1]
    --grace-period SECS  time ranks get to exit after SIGTERM before SIGKILL [5]
    --max-restarts N     start the job again, up to N times, when a rank fails [0]
    --no-prefix          do not prefix output lines with [rankN]:
    --standalone         accepted for torchrun compatibility (one machine, free port)
    -h, --help           print this help
    -V, --version        print the version

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT and CANDLE_PARALLEL_TOKEN (random on one machine; set it yourself, the same on
every machine, for several). With several ranks per machine and RAYON_NUM_THREADS unset,
each rank's compute pool gets the machine's cores divided by the ranks (RAYON_NUM_THREADS,
as torchrun sets OMP_NUM_THREADS=1). When a rank fails the others are stopped and candle-run exits
with the failing rank's status; with --max-restarts N it first starts every rank again (a new
round, with a new rendezvous), up to N times, each rank seeing its round in
TORCHELASTIC_RESTART_COUNT (0 first) to resume from its checkpoint. On several machines give
every launcher the same --max-restarts. Ctrl-C and SIGTERM stop the job without a restart.
Options also take the torchrun spellings (--nproc_per_node).";

/// What the command line asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parsed {
    /// Start `program args` under `config`.
    Run {
        /// How to start it.
        config: LaunchConfig,
        /// The program.
        program: OsString,
        /// Its arguments.
        args: Vec<OsString>,
    },
    /// Print the help.
    Help,
    /// Print the version.
    Version,
}

fn bad(what: &str, detail: String) -> Error {
    Error::Config {
        what: what.to_string(),
        detail,
    }
}

fn number<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T> {
    value
        .parse()
        .map_err(|_| bad(flag, format!("{value:?} is not a valid number")))
}

/// Parses `candle-run`'s arguments (without the program name).
pub fn parse_args(args: impl IntoIterator<Item = OsString>) -> Result<Parsed> {
    let mut config = LaunchConfig::default();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let Some(text) = arg.to_str().filter(|t| t.starts_with('-')) else {
            return Ok(Parsed::Run {
                config,
                program: arg,
                args: args.collect(),
            });
        };
        let (flag, inline) = match text.split_once('=') {
            Some((f, v)) => (f.replace('_', "-"), Some(v.to_string())),
            None => (text.replace('_', "-"), None),
        };
        let mut value = || -> Result<String> {
            match inline.clone() {
                Some(v) => Ok(v),
                None => args
                    .next()
                    .and_then(|v| v.into_string().ok())
                    .ok_or_else(|| bad(&flag, "needs a value".into())),
            }
        };
        match flag.as_str() {
            "--" => {
                let program = args
                    .next()
                    .ok_or_else(|| bad("PROGRAM", "missing after --".into()))?;
                return Ok(Parsed::Run {
                    config,
                    program,
                    args: args.collect(),
                });
            }
            "-h" | "--help" => return Ok(Parsed::Help),
            "-V" | "--version" => return Ok(Parsed::Version),
            "--nproc-per-node" => {
                let v = value()?;
                config.nproc_per_node = if v == "gpu" {
                    match crate::parallel::devices::gpu_count() {
                        0 => return Err(bad(&flag, "`gpu` but no GPU is visible".into())),
                        n => n,
                    }
                } else {
                    number(&flag, &v)?
                };
            }
            "--nnodes" => config.nnodes = number(&flag, &value()?)?,
            "--node-rank" => config.node_rank = number(&flag, &value()?)?,
            "--master-addr" => config.master_addr = value()?,
            "--master-port" => config.master_port = Some(number(&flag, &value()?)?),
            "--grace-period" => {
                let secs: f64 = number(&flag, &value()?)?;
                if !(0.0..=86_400.0).contains(&secs) {
                    return Err(bad(
                        &flag,
                        format!("{secs} is not a number of seconds in 0..86400"),
                    ));
                }
                config.grace_period = Duration::from_secs_f64(secs);
            }
            "--max-restarts" => config.max_restarts = number(&flag, &value()?)?,
            "--no-prefix" => config.prefix_output = false,
            "--standalone" => {}
            _ => return Err(bad(&flag, "not an option of candle-run".into())),
        }
    }
    Err(bad(
        "PROGRAM",
        "missing: give the program to run, e.g. candle-run --nproc-per-node 2 ./train".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Parsed> {
        parse_args(args.iter().map(OsString::from))
    }

    #[test]
    fn torchrun_options_in_both_spellings() {
        let p = parse(&[
            "--nproc_per_node=4",
            "--nnodes",
            "2",
            "--node-rank=1",
            "--master_addr",
            "10.0.0.1",
            "--master-port",
            "29500",
            "--grace-period",
            "0.5",
            "--no-prefix",
            "train",
            "--lr",
            "0.1",
        ])
        .unwrap();
        let Parsed::Run {
            config,
            program,
            args,
        } = p
        else {
            panic!("not a run")
        };
        assert_eq!(config.nproc_per_node, 4);
        assert_eq!((config.nnodes, config.node_rank), (2, 1));
        assert_eq!(config.master_addr, "10.0.0.1");
        assert_eq!(config.master_port, Some(29500));
        assert_eq!(config.grace_period, Duration::from_millis(500));
        assert!(!config.prefix_output);
        assert_eq!(config.max_restarts, 0, "torchrun's default: no restart");
        assert_eq!(program, "train");
        assert_eq!(args, ["--lr", "0.1"]);
    }

    #[test]
    fn max_restarts_in_both_spellings() {
        for args in [
            &["--max-restarts", "3", "p"][..],
            &["--max_restarts=3", "p"],
            &["--max-restarts=3", "p"],
        ] {
            let Parsed::Run { config, .. } = parse(args).unwrap() else {
                panic!("not a run")
            };
            assert_eq!(config.max_restarts, 3, "{args:?}");
        }
        let err = parse(&["--max-restarts", "-1", "p"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"-1\" is not a valid number"), "{err}");
    }

    #[test]
    fn the_program_may_follow_a_double_dash() {
        let Parsed::Run { program, args, .. } = parse(&["--", "-weird", "x"]).unwrap() else {
            panic!()
        };
        assert_eq!((program.to_str().unwrap(), args.len()), ("-weird", 1));
    }

    #[test]
    fn mistakes_are_explained() {
        let err = |a: &[&str]| parse(a).unwrap_err().to_string();
        assert!(err(&["--nproc-per-node", "x", "p"]).contains("\"x\" is not a valid number"));
        assert!(err(&["--frobnicate", "p"]).contains("--frobnicate: not an option of candle-run"));
        assert!(err(&["--nnodes", "2"]).contains("PROGRAM: missing"));
        assert!(err(&["--master-port"]).contains("needs a value"));
        assert_eq!(parse(&["-h"]).unwrap(), Parsed::Help);
        let Parsed::Run { config, .. } = parse(&["--nnodes", "2", "p"]).unwrap() else {
            panic!()
        };
        let invalid = config.validate().unwrap_err().to_string();
        assert!(
            invalid.contains("--master-port") && invalid.contains("required"),
            "{invalid}"
        );
    }
}
