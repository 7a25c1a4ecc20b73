//! The CIFAR-10 binary format.

use super::error::{Error, Result};
use super::{Cifar10, Split, IMAGE_BYTES, RECORD_BYTES};
use std::path::{Path, PathBuf};

/// The training files of the binary version, in order.
pub const TRAIN_FILES: [&str; 5] = [
    "data_batch_1.bin",
    "data_batch_2.bin",
    "data_batch_3.bin",
    "data_batch_4.bin",
    "data_batch_5.bin",
];
/// The test file of the binary version.
pub const TEST_FILE: &str = "test_batch.bin";

/// Reads the six files of the binary version from `dir`, or from `dir/cifar-10-batches-bin`
/// when that is where they are (the layout the archive unpacks to).
pub fn load(dir: impl AsRef<Path>) -> Result<Cifar10> {
    let dir = dir.as_ref();
    let nested = dir.join("cifar-10-batches-bin");
    let dir = if !dir.join(TEST_FILE).exists() && nested.join(TEST_FILE).exists() {
        nested
    } else {
        dir.to_path_buf()
    };
    // Check every file before reading any, so a missing one is reported at once.
    let files: Vec<PathBuf> = TRAIN_FILES
        .iter()
        .chain([&TEST_FILE])
        .map(|f| dir.join(f))
        .collect();
    for path in &files {
        check_file(path)?;
    }
    let mut train = Split::default();
    for path in &files[..TRAIN_FILES.len()] {
        let part = read_batch_file(path)?;
        train.images.extend(part.images);
        train.labels.extend(part.labels);
    }
    let test = read_batch_file(&files[TRAIN_FILES.len()])?;
    Ok(Cifar10 { train, test })
}

/// Fails unless `path` is a regular file (or a link to one), saying what is there instead:
/// nothing, a directory, a FIFO (which reading would block on), a link that loops...
fn check_file(path: &Path) -> Result<()> {
    let not_regular = |what: &str| Error::NotRegular {
        path: path.to_path_buf(),
        what: what.to_string(),
    };
    let link = std::fs::symlink_metadata(path);
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) => {
            return Err(match (&link, e.kind()) {
                (Err(_), _) => Error::Missing {
                    path: path.to_path_buf(),
                },
                (Ok(_), std::io::ErrorKind::NotFound) => {
                    not_regular("a symbolic link to a file that does not exist")
                }
                // ELOOP: too many levels of symbolic links.
                (Ok(_), _) if e.raw_os_error() == Some(40) => {
                    not_regular("a symbolic link that loops")
                }
                (Ok(_), _) => Error::File {
                    action: "reading",
                    path: path.to_path_buf(),
                    source: e,
                },
            });
        }
    };
    let kind = meta.file_type();
    if kind.is_file() {
        return Ok(());
    }
    Err(not_regular(if kind.is_dir() {
        "a directory"
    } else {
        special_kind(kind)
    }))
}

/// What a file that is neither regular nor a directory is.
#[cfg(unix)]
fn special_kind(kind: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_fifo() {
        "a FIFO (named pipe)"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_block_device() || kind.is_char_device() {
        "a device"
    } else {
        "something other than a file"
    }
}

#[cfg(not(unix))]
fn special_kind(_: std::fs::FileType) -> &'static str {
    "something other than a file"
}

/// Reads one file of the binary version: any number of whole records.
pub fn read_batch_file(path: impl AsRef<Path>) -> Result<Split> {
    let path = path.as_ref();
    check_file(path)?;
    let bytes = std::fs::read(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => Error::Missing {
            path: path.to_path_buf(),
        },
        _ => Error::File {
            action: "reading",
            path: path.to_path_buf(),
            source,
        },
    })?;
    if bytes.len() % RECORD_BYTES != 0 {
        return Err(Error::Size {
            path: path.to_path_buf(),
            size: bytes.len() as u64,
            record: RECORD_BYTES,
        });
    }
    let n = bytes.len() / RECORD_BYTES;
    let mut split = Split {
        images: Vec::with_capacity(n * IMAGE_BYTES),
        labels: Vec::with_capacity(n),
    };
    for (record, chunk) in bytes.chunks_exact(RECORD_BYTES).enumerate() {
        let label = chunk[0];
        if label > 9 {
            return Err(Error::Label {
                path: path.to_path_buf(),
                record,
                label,
            });
        }
        split.labels.push(label);
        split.images.extend_from_slice(&chunk[1..]);
    }
    Ok(split)
}

/// Writes `split` in the binary format (used to make test fixtures and to export synthetic data).
pub fn write_batch_file(path: impl AsRef<Path>, split: &Split) -> Result<()> {
    let path = path.as_ref();
    let mut bytes = Vec::with_capacity(split.len() * RECORD_BYTES);
    for (i, &label) in split.labels.iter().enumerate() {
        bytes.push(label);
        bytes.extend_from_slice(&split.images[i * IMAGE_BYTES..(i + 1) * IMAGE_BYTES]);
    }
    std::fs::write(path, bytes).map_err(|source| Error::File {
        action: "writing",
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cifar::synthetic;
    use candle_core::Device;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("cp-cifar-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Writes the six files with 3, 4, 5, 6, 7 and 2 records.
    fn write_dataset(dir: &Path) -> Cifar10 {
        let data = synthetic(25, 2, 11);
        let mut start = 0;
        for (i, file) in TRAIN_FILES.iter().enumerate() {
            let n = i + 3;
            let part = Split {
                images: data.train.images[start * IMAGE_BYTES..(start + n) * IMAGE_BYTES].to_vec(),
                labels: data.train.labels[start..start + n].to_vec(),
            };
            write_batch_file(dir.join(file), &part).unwrap();
            start += n;
        }
        write_batch_file(dir.join(TEST_FILE), &data.test).unwrap();
        data
    }

    #[test]
    fn reads_generated_files_with_any_record_count(
    ) -> std::result::Result<(), Box<dyn std::error::Error>> {
        let dir = temp_dir("ok");
        let want = write_dataset(&dir);
        let got = load(&dir)?;
        assert_eq!(got, want);
        // The archive's nested layout is found too.
        let parent = temp_dir("nested");
        std::fs::rename(&dir, parent.join("cifar-10-batches-bin")).unwrap();
        assert_eq!(load(&parent)?, want);
        // Pixels are normalised as (x/255 - 0.5)/0.5.
        let (x, y) = got.test.batch(&[1], &Device::Cpu)?;
        let first = x.flatten_all()?.to_vec1::<f32>()?[0];
        let byte = f32::from(got.test.images[IMAGE_BYTES]);
        assert_eq!(first, (byte / 255.0 - 0.5) / 0.5);
        assert_eq!(y.to_vec1::<u32>()?, [u32::from(got.test.labels[1])]);
        std::fs::remove_dir_all(parent).unwrap();
        Ok(())
    }

    #[test]
    fn a_truncated_file_is_reported_with_its_name_and_size() {
        let dir = temp_dir("trunc");
        write_dataset(&dir);
        let path = dir.join("data_batch_3.bin");
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
        let err = load(&dir).unwrap_err();
        match &err {
            Error::Size { path: p, size, .. } => {
                assert_eq!(p, &path);
                assert_eq!(*size as usize, bytes.len() - 100);
            }
            other => panic!("unexpected error {other}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains("data_batch_3.bin") && msg.contains("15265 bytes"),
            "{msg}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_missing_file_is_named() {
        let dir = temp_dir("missing");
        write_dataset(&dir);
        std::fs::remove_file(dir.join(TEST_FILE)).unwrap();
        let err = load(&dir).unwrap_err();
        assert!(matches!(&err, Error::Missing { path } if path.ends_with(TEST_FILE)));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn what_stands_in_place_of_a_file_is_named_and_a_fifo_is_not_read() {
        let dir = temp_dir("not-a-file");
        write_dataset(&dir);
        let test = dir.join(TEST_FILE);
        let cases: [(&str, &dyn Fn()); 4] = [
            ("a directory", &|| std::fs::create_dir(&test).unwrap()),
            ("a FIFO (named pipe)", &|| {
                let name = std::ffi::CString::new(test.to_str().unwrap()).unwrap();
                // SAFETY: mkfifo with a valid C string.
                assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
            }),
            ("a symbolic link that loops", &|| {
                let other = dir.join("loop.bin");
                std::os::unix::fs::symlink(&other, &test).unwrap();
                std::os::unix::fs::symlink(&test, &other).unwrap();
            }),
            ("a symbolic link to a file that does not exist", &|| {
                std::os::unix::fs::symlink(dir.join("nowhere.bin"), &test).unwrap();
            }),
        ];
        for (what, make) in cases {
            let _ = std::fs::remove_file(&test);
            let _ = std::fs::remove_dir(&test);
            let _ = std::fs::remove_file(dir.join("loop.bin"));
            make();
            // A FIFO would block a read: this must return at once.
            let err = load(&dir).unwrap_err();
            assert!(
                matches!(&err, Error::NotRegular { what: w, .. } if w == what),
                "{what}: {err}"
            );
            assert!(err.to_string().contains(TEST_FILE), "{err}");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_label_outside_the_classes_is_refused() {
        let dir = temp_dir("label");
        let path = dir.join("bad.bin");
        let mut bytes = vec![0u8; 2 * RECORD_BYTES];
        bytes[RECORD_BYTES] = 12;
        std::fs::write(&path, bytes).unwrap();
        let err = read_batch_file(&path).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Label {
                    record: 1,
                    label: 12,
                    ..
                }
            ),
            "{err}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
