//! `candle-run`'s command line: torchrun's options, then the program and its arguments.

use super::{ElasticConfig, LaunchConfig};
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
    --nnodes MIN:MAX     elastic membership: each round runs with the MIN to MAX machines
                         that are there (torchrun's c10d rendezvous; see below)
    --node-rank K        this machine's index in 0..M [0] (not with MIN:MAX: assigned per round)
    --master-addr ADDR   address of the machine running rank 0 [127.0.0.1]; with MIN:MAX, of
                         the machine whose launcher hosts the rendezvous
    --master-port PORT   port of rank 0's store [a free port; required when M > 1], or of the
                         rendezvous with MIN:MAX
    --rdzv-last-call SECS   MIN:MAX: once MIN machines joined, wait this long for more [30]
    --rdzv-join-timeout SECS  MIN:MAX: fail when no round closes within this [600]
    --rdzv-keep-alive SECS  MIN:MAX: a launcher silent this long counts as lost [15]
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

Elastic membership (--nnodes MIN:MAX): start the same command on every machine (no
--node-rank). The launcher on --master-addr hosts the rendezvous; the others join it. A round
closes when MAX machines joined, or when MIN did and --rdzv-last-call passed; each round numbers
the machines (GROUP_RANK, GROUP_WORLD_SIZE) and their ranks (RANK, WORLD_SIZE) anew. When a rank
fails, every launcher stops its ranks and joins the next round with the machines still there
(counted against --max-restarts); a machine that arrives while a round runs makes the running
launchers restart within about a second (not counted) so that it joins. Losing the machine
that hosts the rendezvous ends the job. Programs resume from their checkpoint at the new world
size.
Options also take the torchrun spellings (--nproc_per_node).";

/// What the command line asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
// Made once per launcher: the size of `Run` costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
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

/// A number of seconds in `0..=86400` for `flag`.
fn seconds(flag: &str, value: &str) -> Result<Duration> {
    let secs: f64 = number(flag, value)?;
    if !(0.0..=86_400.0).contains(&secs) {
        return Err(bad(
            flag,
            format!("{secs} is not a number of seconds in 0..86400"),
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// `--nnodes`: `N`, or `MIN:MAX` (elastic).
fn nodes(flag: &str, value: &str) -> Result<(usize, Option<(usize, usize)>)> {
    match value.split_once(':') {
        None => Ok((number(flag, value)?, None)),
        Some((min, max)) => {
            let (min, max): (usize, usize) = (number(flag, min)?, number(flag, max)?);
            if min == 0 || min > max {
                return Err(bad(
                    flag,
                    format!("{value:?} is not a range MIN:MAX with 1 <= MIN <= MAX"),
                ));
            }
            Ok((max, Some((min, max))))
        }
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
    let mut elastic: Option<ElasticConfig> = None;
    let mut node_rank_given = false;
    let mut rdzv_given = false;
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let Some(text) = arg.to_str().filter(|t| t.starts_with('-')) else {
            finish_elastic(&mut config, elastic, node_rank_given)?;
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
                finish_elastic(&mut config, elastic, node_rank_given)?;
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
            "--nnodes" => {
                let (n, range) = nodes(&flag, &value()?)?;
                config.nnodes = n;
                let last = elastic.take();
                elastic = match range {
                    Some((min_nodes, max_nodes)) => Some(ElasticConfig {
                        min_nodes,
                        max_nodes,
                        ..last.unwrap_or_default()
                    }),
                    // `--rdzv-*` given before a plain `--nnodes N`: kept, not elastic, so that
                    // `finish_elastic` refuses it rather than drop it in silence.
                    None => last
                        .filter(|_| rdzv_given)
                        .map(|e| ElasticConfig { min_nodes: 0, ..e }),
                };
            }
            "--node-rank" => {
                config.node_rank = number(&flag, &value()?)?;
                node_rank_given = true;
            }
            "--rdzv-last-call" | "--rdzv-join-timeout" | "--rdzv-keep-alive" => {
                let d = seconds(&flag, &value()?)?;
                rdzv_given = true;
                let e = elastic.get_or_insert_with(|| ElasticConfig {
                    // Not elastic (yet): `finish_elastic` refuses it unless --nnodes MIN:MAX.
                    min_nodes: 0,
                    ..ElasticConfig::default()
                });
                match flag.as_str() {
                    "--rdzv-last-call" => e.last_call = d,
                    "--rdzv-join-timeout" => e.join_timeout = d,
                    _ => e.keep_alive = d,
                }
            }
            "--master-addr" => config.master_addr = value()?,
            "--master-port" => config.master_port = Some(number(&flag, &value()?)?),
            "--grace-period" => config.grace_period = seconds(&flag, &value()?)?,
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

/// Puts the elastic options into `config`: refuses `--rdzv-*` without `--nnodes MIN:MAX`, and
/// `--node-rank` with it (each round numbers the machines).
fn finish_elastic(
    config: &mut LaunchConfig,
    elastic: Option<ElasticConfig>,
    node_rank_given: bool,
) -> Result<()> {
    match elastic {
        Some(e) if e.min_nodes == 0 => Err(bad(
            "--rdzv-last-call, --rdzv-join-timeout, --rdzv-keep-alive",
            "only with --nnodes MIN:MAX (elastic membership); a plain --nnodes N has no \
             rendezvous rounds"
                .into(),
        )),
        Some(_) if node_rank_given => Err(bad(
            "--node-rank",
            "not with --nnodes MIN:MAX: each round numbers the machines itself (GROUP_RANK); \
             drop --node-rank"
                .into(),
        )),
        e => {
            config.elastic = e;
            Ok(())
        }
    }
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
    fn nnodes_min_max_is_elastic_and_a_plain_nnodes_is_not() {
        let Parsed::Run { config, .. } = parse(&[
            "--rdzv_last_call=2.5",
            "--nnodes",
            "1:3",
            "--rdzv-join-timeout",
            "60",
            "--rdzv-keep-alive=4",
            "--master-port",
            "29500",
            "p",
        ])
        .unwrap() else {
            panic!("not a run")
        };
        let e = config.elastic.clone().expect("elastic");
        assert_eq!((e.min_nodes, e.max_nodes, config.nnodes), (1, 3, 3));
        assert_eq!(e.last_call, Duration::from_millis(2500));
        assert_eq!(e.join_timeout, Duration::from_secs(60));
        assert_eq!(e.keep_alive, Duration::from_secs(4));
        config.validate().unwrap();
        let Parsed::Run { config, .. } = parse(&["--nnodes", "2", "p"]).unwrap() else {
            panic!("not a run")
        };
        assert_eq!((config.nnodes, config.elastic), (2, None));

        let err = |a: &[&str]| parse(a).unwrap_err().to_string();
        assert!(err(&["--nnodes", "3:2", "p"]).contains("not a range MIN:MAX"));
        assert!(err(&["--nnodes", "0:2", "p"]).contains("not a range MIN:MAX"));
        assert!(err(&["--nnodes", "1:x", "p"]).contains("\"x\" is not a valid number"));
        assert!(err(&["--nnodes", "2", "--rdzv-last-call", "3", "p"])
            .contains("only with --nnodes MIN:MAX"));
        // In either order: a --rdzv-* flag before a plain --nnodes N is refused too.
        assert!(err(&["--rdzv-keep-alive", "3", "--nnodes", "2", "p"])
            .contains("only with --nnodes MIN:MAX"));
        let Parsed::Run { config, .. } = parse(&["--nnodes", "1:2", "--nnodes", "2", "p"]).unwrap()
        else {
            panic!("not a run")
        };
        assert_eq!(config.elastic, None);
        assert!(err(&["--nnodes", "1:2", "--node-rank", "1", "p"])
            .contains("--node-rank: not with --nnodes MIN:MAX"));
        let Parsed::Run { config, .. } = parse(&["--nnodes", "1:2", "p"]).unwrap() else {
            panic!("not a run")
        };
        let invalid = config.validate().unwrap_err().to_string();
        assert!(
            invalid.contains("--master-port") && invalid.contains("required"),
            "{invalid}"
        );
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
