//! The checkpoint's index (`index.json`): every tensor's whole shape and dtype, and where each
//! of its pieces is stored; and the reading of those pieces from the ranks' files, each checked
//! against its checksum and against the save it belongs to.

use super::region::Region;
use crate::checkpoint::format::{checksum, CHECKSUM, CRC32C};
use crate::error::{Error, Result};
use candle_core::DType;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The index's file name in a checkpoint's folder.
pub const INDEX_FILE: &str = "index.json";
/// What the index's `format` field says.
pub(crate) const FORMAT: &str = "candle-parallel distributed checkpoint";
/// The version of the format this code writes and reads.
pub(crate) const VERSION: u32 = 1;
/// The metadata entry of a rank's file naming the save it belongs to.
pub(crate) const SAVE_ID: &str = "save_id";

/// One file of a save.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct FileEntry {
    /// Its name in the folder.
    pub name: String,
    /// The rank that wrote it.
    pub rank: usize,
    /// Its length.
    pub bytes: u64,
}

/// One stored piece of a tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PieceEntry {
    /// Its file, an index into [`IndexFile::files`].
    pub file: usize,
    /// Its key in that file.
    pub key: String,
    /// Where it sits in the whole tensor.
    pub region: Region,
}

/// One tensor of the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TensorEntry {
    /// candle's name of its dtype (`f32`, `bf16`, ...).
    pub dtype: String,
    /// Its whole shape.
    pub shape: Vec<usize>,
    /// Its pieces, which tile it.
    pub pieces: Vec<PieceEntry>,
}

/// The contents of `index.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct IndexFile {
    pub format: String,
    pub version: u32,
    /// A random name of this save, also in every one of its files.
    pub save_id: String,
    /// How many ranks saved it.
    pub world_size: usize,
    pub files: Vec<FileEntry>,
    pub tensors: BTreeMap<String, TensorEntry>,
}

/// A committed checkpoint's index: what it holds, without reading any tensor.
#[derive(Clone, Debug)]
pub struct Index {
    pub(crate) dir: PathBuf,
    pub(crate) file: IndexFile,
}

impl Index {
    /// Reads the index of the checkpoint in `dir`: an error naming the file when there is none
    /// (no save ever finished there) or it is not an index this version reads.
    pub fn read(dir: impl AsRef<Path>) -> Result<Index> {
        let dir = dir.as_ref();
        let path = dir.join(INDEX_FILE);
        let bytes = std::fs::read(&path).map_err(|source| Error::File {
            action: "reading the checkpoint's index",
            path: path.clone(),
            source,
        })?;
        let bad = |detail: String| Error::Checkpoint {
            key: String::new(),
            path: path.clone(),
            detail,
        };
        let file: IndexFile = serde_json::from_slice(&bytes)
            .map_err(|e| bad(format!("not an index of a distributed checkpoint: {e}")))?;
        if file.format != FORMAT || file.version != VERSION {
            return Err(bad(format!(
                "format `{}` version {}; this version reads `{FORMAT}` version {VERSION}",
                file.format, file.version
            )));
        }
        for (key, t) in &file.tensors {
            t.dtype
                .parse::<DType>()
                .map_err(|_| bad(format!("`{key}` has an unknown dtype `{}`", t.dtype)))?;
            // A region that does not fit would make the element arithmetic of a load index
            // out of bounds.
            let misfit = t
                .pieces
                .iter()
                .find_map(|p| Some((p, p.region.misfit(&t.shape)?)));
            if let Some((p, why)) = misfit {
                return Err(bad(format!(
                    "`{key}`'s piece `{}`: {why}: the index is corrupt",
                    p.key
                )));
            }
            if let Some(p) = t.pieces.iter().find(|p| p.file >= file.files.len()) {
                return Err(bad(format!(
                    "`{key}`'s piece `{}` is in file {} of {}: the index is corrupt",
                    p.key,
                    p.file,
                    file.files.len()
                )));
            }
        }
        Ok(Index {
            dir: dir.to_path_buf(),
            file,
        })
    }

    /// The folder of the checkpoint.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The names of its tensors, in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.file.tensors.keys().map(String::as_str)
    }

    /// Whether it holds tensor `key`.
    pub fn contains(&self, key: &str) -> bool {
        self.file.tensors.contains_key(key)
    }

    /// The whole shape of tensor `key`.
    pub fn shape(&self, key: &str) -> Option<&[usize]> {
        self.file.tensors.get(key).map(|t| t.shape.as_slice())
    }

    /// The dtype tensor `key` was saved in.
    pub fn dtype(&self, key: &str) -> Option<DType> {
        self.file
            .tensors
            .get(key)
            .and_then(|t| t.dtype.parse().ok())
    }

    /// How many ranks saved it.
    pub fn world_size(&self) -> usize {
        self.file.world_size
    }

    /// The save's random name (also in every file of the save).
    pub fn save_id(&self) -> &str {
        &self.file.save_id
    }

    /// The names of the files of the save.
    pub fn files(&self) -> impl Iterator<Item = &str> {
        self.file.files.iter().map(|f| f.name.as_str())
    }
}

/// A stored tensor's place in its file, from the file's header.
struct Stored {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    begin: u64,
    end: u64,
}

/// A tensor's entry in a safetensors header.
#[derive(Deserialize)]
struct HeaderEntry {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data_offsets: [u64; 2],
}

/// One rank's file, opened: its header read and checked against the index.
struct Opened {
    file: std::fs::File,
    path: PathBuf,
    data_start: u64,
    tensors: HashMap<String, Stored>,
    checksums: BTreeMap<String, String>,
}

/// A stored piece read from its file: its dtype and bytes.
pub(crate) type StoredBytes = Arc<(DType, Vec<u8>)>;

/// The ranks' files of a checkpoint, opened as they are first needed; each stored piece read
/// once and checked against its checksum.
pub(crate) struct Reader<'a> {
    index: &'a Index,
    opened: HashMap<usize, Opened>,
    pieces: HashMap<(usize, String), StoredBytes>,
}

impl<'a> Reader<'a> {
    pub fn new(index: &'a Index) -> Self {
        Self {
            index,
            opened: HashMap::new(),
            pieces: HashMap::new(),
        }
    }

    fn open(&mut self, file: usize) -> Result<&Opened> {
        if !self.opened.contains_key(&file) {
            let opened = open(self.index, file)?;
            self.opened.insert(file, opened);
        }
        Ok(&self.opened[&file])
    }

    /// The bytes of stored piece `key` of file `file`, checked.
    pub fn piece(&mut self, file: usize, key: &str) -> Result<StoredBytes> {
        let id = (file, key.to_string());
        if let Some(p) = self.pieces.get(&id) {
            return Ok(p.clone());
        }
        let opened = self.open(file)?;
        let bad = |detail: String| Error::Checkpoint {
            key: key.to_string(),
            path: opened.path.clone(),
            detail,
        };
        let stored = opened.tensors.get(key).ok_or_else(|| {
            bad(format!(
                "the index places `{key}` in this file, which has no such tensor: the file was \
                 replaced, or the index is of another save"
            ))
        })?;
        let mut data = vec![0u8; (stored.end - stored.begin) as usize];
        read_at(&opened.file, &mut data, opened.data_start + stored.begin).map_err(|source| {
            Error::File {
                action: "reading a checkpoint piece from",
                path: opened.path.clone(),
                source,
            }
        })?;
        let dtype_name = format!("{:?}", stored.dtype);
        let got = format!("{:08x}", checksum(&dtype_name, &stored.shape, &data));
        match opened.checksums.get(key) {
            Some(want) if *want == got => {}
            Some(want) => {
                return Err(bad(format!(
                    "`{key}` does not match the checksum written with it ({dtype_name} {:?}: \
                     CRC-32C {got}, written {want}): the file is corrupt (flipped bits, a \
                     changed header, a torn copy); nothing was loaded",
                    stored.shape
                )))
            }
            None => {
                return Err(bad(format!(
                    "`{key}` has no checksum, though the file's other tensors have one: the \
                     header was changed"
                )))
            }
        }
        let dtype = DType::try_from(stored.dtype)
            .map_err(|e| bad(format!("`{key}` has a dtype candle cannot hold: {e}")))?;
        let piece = Arc::new((dtype, data));
        self.pieces.insert(id, piece.clone());
        Ok(piece)
    }
}

#[cfg(unix)]
fn read_at(file: &std::fs::File, buf: &mut [u8], at: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.read_exact_at(buf, at)
}

#[cfg(not(unix))]
fn read_at(mut file: &std::fs::File, buf: &mut [u8], at: u64) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    file.seek(SeekFrom::Start(at))?;
    file.read_exact(buf)
}

/// Opens file `file` of `index`'s save and reads its header: an error naming the file when it
/// is missing, shorter or longer than the index says, of another save, or not checksummed.
fn open(index: &Index, file: usize) -> Result<Opened> {
    let entry = &index.file.files[file];
    let path = index.dir.join(&entry.name);
    let bad = |detail: String| Error::Checkpoint {
        key: String::new(),
        path: path.clone(),
        detail,
    };
    let f = std::fs::File::open(&path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => bad(format!(
            "rank {}'s file of this checkpoint is missing: the folder was copied in part, or \
             a file was removed",
            entry.rank
        )),
        _ => Error::File {
            action: "opening a checkpoint file",
            path: path.clone(),
            source,
        },
    })?;
    let len = f
        .metadata()
        .map_err(|source| Error::File {
            action: "reading the length of",
            path: path.clone(),
            source,
        })?
        .len();
    if len != entry.bytes {
        return Err(bad(format!(
            "the file is {len} bytes and the index says {}: a torn copy, or a file of another \
             save",
            entry.bytes
        )));
    }
    let mut head = [0u8; 8];
    read_at(&f, &mut head, 0).map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    let n = u64::from_le_bytes(head);
    if n > len.saturating_sub(8) || n > 1 << 30 {
        return Err(bad(format!(
            "its header claims {n} bytes, which the file cannot hold: not a safetensors file"
        )));
    }
    let mut header = vec![0u8; n as usize];
    read_at(&f, &mut header, 8).map_err(|e| bad(format!("reading its header: {e}")))?;
    let mut header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| bad(format!("its header is not safetensors' JSON: {e}")))?;
    let metadata: BTreeMap<String, String> = match header.remove("__metadata__") {
        Some(m) => serde_json::from_value(m)
            .map_err(|e| bad(format!("its metadata is not a map of strings: {e}")))?,
        None => BTreeMap::new(),
    };
    match metadata.get(SAVE_ID) {
        Some(id) if *id == index.file.save_id => {}
        Some(id) => {
            return Err(bad(format!(
                "the file is of save `{id}` and the index of save `{}`: the folder holds pieces \
                 of two saves (a torn save, or files copied over)",
                index.file.save_id
            )))
        }
        None => {
            return Err(bad(
                "the file names no save: it is not of this checkpoint".into()
            ))
        }
    }
    if metadata.get(CHECKSUM).map(String::as_str) != Some(CRC32C) {
        return Err(bad(format!(
            "the file has no {CRC32C} checksums: not written by a distributed save"
        )));
    }
    let data_len = len - 8 - n;
    let mut tensors = HashMap::new();
    for (name, v) in header {
        let HeaderEntry {
            dtype,
            shape,
            data_offsets: [begin, end],
        } = serde_json::from_value(v)
            .map_err(|e| bad(format!("`{name}`'s header entry is malformed: {e}")))?;
        if begin > end || end > data_len {
            return Err(bad(format!(
                "`{name}` lies at bytes {begin}..{end} of {data_len}: a torn file"
            )));
        }
        tensors.insert(
            name,
            Stored {
                dtype,
                shape,
                begin,
                end,
            },
        );
    }
    let checksums = metadata
        .into_iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(&format!("{CRC32C}."))?.to_string(), v)))
        .collect();
    Ok(Opened {
        file: f,
        path,
        data_start: 8 + n,
        tensors,
        checksums,
    })
}
