//! What can go wrong reading and writing the CIFAR-10 binary files: the dataset's own error,
//! apart from the crate's [`Error`](crate::Error), which is about training.

use std::path::PathBuf;

/// What went wrong with a CIFAR-10 file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A CIFAR-10 file is missing.
    #[error(
        "CIFAR-10 file {path} is missing: the binary version has data_batch_1.bin .. \
         data_batch_5.bin and test_batch.bin (cifar-10-binary.tar.gz, folder cifar-10-batches-bin)"
    )]
    Missing {
        /// The file that was looked for.
        path: PathBuf,
    },

    /// Something other than a regular file stands where a CIFAR-10 file should be.
    #[error(
        "CIFAR-10 file {path} is {what}, not a regular file: put the binary version's file there \
         (data_batch_1.bin .. data_batch_5.bin, test_batch.bin)"
    )]
    NotRegular {
        /// The path.
        path: PathBuf,
        /// What is there.
        what: String,
    },

    /// A CIFAR-10 file does not hold a whole number of records.
    #[error(
        "CIFAR-10 file {path} has {size} bytes, which is not a whole number of {record}-byte records \
         (1 label byte + 3072 pixel bytes); the file is truncated or not the binary version"
    )]
    Size {
        /// The file.
        path: PathBuf,
        /// Its size in bytes.
        size: u64,
        /// The record size.
        record: usize,
    },

    /// A CIFAR-10 record has a label outside 0..=9.
    #[error("CIFAR-10 file {path}, record {record}: label {label} is not a class in 0..=9")]
    Label {
        /// The file.
        path: PathBuf,
        /// The record's index in the file.
        record: usize,
        /// The label byte found.
        label: u8,
    },

    /// An I/O operation on a file failed.
    #[error("{action} {path}: {source}")]
    File {
        /// What was being done ("reading", "writing").
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// The result of the CIFAR-10 reader and writer.
pub type Result<T> = std::result::Result<T, Error>;
