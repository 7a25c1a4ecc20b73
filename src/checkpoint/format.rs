//! The safetensors files of this crate's checkpoints, with a CRC-32C of every tensor in the
//! file's metadata, checked when the file is read.
//!
//! Each tensor's checksum covers its dtype and shape (as text) and then its bytes, so that a
//! flipped bit in the data and a changed dtype or shape in the header are both caught; it is
//! stored under `crc32c.<name>` in the `__metadata__` map, beside `checksum = crc32c`. A file
//! without that entry (written by another program, or before checksums) is read with a warning.
//! Files are written by streaming the tensors' own bytes: no copy of the whole file in memory.

use super::crc32c;
use crate::error::{Error, Result};
use candle_core::safetensors::Load;
use candle_core::{CpuStorage, Device, Storage, Tensor};
use rayon::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;

/// The metadata entry that says the file carries checksums, and of which kind.
pub(crate) const CHECKSUM: &str = "checksum";
pub(crate) const CRC32C: &str = "crc32c";

/// Calls `f` with the bytes of `t`'s elements in row-major order: a view of its memory for a
/// contiguous CPU tensor of a common dtype, else a copy.
fn with_bytes<R>(t: &Tensor, f: impl FnOnce(&[u8]) -> R) -> R {
    fn bytes<T>(v: &[T]) -> &[u8] {
        // SAFETY: a slice of plain numbers is readable as its bytes, for as long as it lives.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
    }
    if t.device().is_cpu() {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets()) {
            let view = match cpu {
                CpuStorage::U8(v) => Some(&v[a..b]),
                CpuStorage::U32(v) => Some(bytes(&v[a..b])),
                CpuStorage::I16(v) => Some(bytes(&v[a..b])),
                CpuStorage::I32(v) => Some(bytes(&v[a..b])),
                CpuStorage::I64(v) => Some(bytes(&v[a..b])),
                CpuStorage::BF16(v) => Some(bytes(&v[a..b])),
                CpuStorage::F16(v) => Some(bytes(&v[a..b])),
                CpuStorage::F32(v) => Some(bytes(&v[a..b])),
                CpuStorage::F64(v) => Some(bytes(&v[a..b])),
                _ => None,
            };
            if let Some(view) = view {
                return f(view);
            }
        }
    }
    f(&<&Tensor as safetensors::View>::data(&t))
}

/// The checksum of a tensor of `dtype` and `shape` (as safetensors names them) with `data`.
pub(crate) fn checksum(dtype: &str, shape: &[usize], data: &[u8]) -> u32 {
    let head = format!("{dtype}{shape:?}");
    crc32c::extend(crc32c::extend(0, head.as_bytes()), data)
}

fn dtype_name(t: &Tensor) -> String {
    let dtype: safetensors::Dtype = t.dtype().into();
    format!("{dtype:?}")
}

/// `s` as a JSON string.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A safetensors file's contents, ready to stream: the header and the tensors in file order.
pub(crate) struct Prepared {
    header: Vec<u8>,
    tensors: Vec<Tensor>,
    /// The file's length.
    pub len: u64,
}

/// Lays out `tensors` (on the host) as a safetensors file whose metadata holds each one's
/// checksum, and the `extra` entries.
pub(crate) fn prepare_with(
    tensors: &HashMap<&str, Tensor>,
    extra: &BTreeMap<String, String>,
) -> Result<Prepared> {
    let mut named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
    named.sort_by_key(|(n, _)| *n);
    let sums: Vec<u32> = named
        .par_iter()
        .map(|(_, t)| with_bytes(t, |b| checksum(&dtype_name(t), t.dims(), b)))
        .collect();
    let mut metadata = extra.clone();
    metadata.insert(CHECKSUM.into(), CRC32C.into());
    for ((name, _), sum) in named.iter().zip(&sums) {
        metadata.insert(format!("{CRC32C}.{name}"), format!("{sum:08x}"));
    }
    let mut entries = vec![format!(
        "\"__metadata__\":{{{}}}",
        metadata
            .iter()
            .map(|(k, v)| format!("{}:{}", json_string(k), json_string(v)))
            .collect::<Vec<_>>()
            .join(",")
    )];
    let mut offset = 0u64;
    for (name, t) in &named {
        let len = (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        entries.push(format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":{:?},\"data_offsets\":[{offset},{}]}}",
            json_string(name),
            dtype_name(t),
            t.dims(),
            offset + len
        ));
        offset += len;
    }
    let mut header = format!("{{{}}}", entries.join(",")).into_bytes();
    // safetensors pads the header to 8 bytes with spaces, so that the data is aligned.
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let len = 8 + header.len() as u64 + offset;
    Ok(Prepared {
        header,
        tensors: named.into_iter().map(|(_, t)| t.clone()).collect(),
        len,
    })
}

impl Prepared {
    /// Writes the file to `out`.
    pub(crate) fn write(&self, out: &mut impl Write) -> std::io::Result<()> {
        out.write_all(&(self.header.len() as u64).to_le_bytes())?;
        out.write_all(&self.header)?;
        for t in &self.tensors {
            with_bytes(t, |b| out.write_all(b))?;
        }
        out.flush()
    }
}

/// Reads every tensor of the safetensors file in `bytes` (read from `path`, named in errors)
/// onto the CPU, after checking each one's checksum when the file has them. A mismatch names
/// the tensor and nothing is returned.
pub(crate) fn parse(bytes: &[u8], path: &Path) -> Result<HashMap<String, Tensor>> {
    let corrupt = |key: &str, detail: String| Error::Checkpoint {
        key: key.to_string(),
        path: path.to_path_buf(),
        detail,
    };
    let (_, metadata) = safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|e| corrupt("", format!("not a safetensors file: {e}")))?;
    let file = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| corrupt("", format!("not a safetensors file: {e}")))?;
    let info = metadata.metadata().clone().unwrap_or_default();
    let views = file.tensors();
    match info.get(CHECKSUM).map(String::as_str) {
        Some(CRC32C) => {
            let bad = views.par_iter().find_map_any(|(name, view)| {
                let dtype = format!("{:?}", view.dtype());
                let Some(want) = info.get(&format!("{CRC32C}.{name}")) else {
                    return Some((
                        name.clone(),
                        "has no checksum, though the file's other tensors have one: the \
                         header was changed"
                            .to_string(),
                    ));
                };
                let got = format!("{:08x}", checksum(&dtype, view.shape(), view.data()));
                (got != *want).then(|| {
                    (
                        name.clone(),
                        format!(
                            "does not match the checksum written with it ({dtype} {:?}: \
                             CRC-32C {got}, written {want}): the file is corrupt (flipped \
                             bits, a changed header, a torn copy)",
                            view.shape()
                        ),
                    )
                })
            });
            if let Some((name, why)) = bad {
                return Err(corrupt(
                    &name,
                    format!("`{name}` {why}; nothing was loaded"),
                ));
            }
        }
        Some(other) => {
            return Err(corrupt(
                "",
                format!(
                    "its checksums are `{other}`, which this version cannot check (it checks \
                     {CRC32C})"
                ),
            ))
        }
        None => log::warn!(
            "{}: the file has no checksums (written by another program, or by an older \
             candle-parallel): its contents cannot be verified",
            path.display()
        ),
    }
    views
        .into_iter()
        .map(|(name, view)| {
            let t = view
                .load(&Device::Cpu)
                .map_err(|e| corrupt(&name, format!("`{name}` cannot be read: {e}")))?;
            Ok((name, t))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    fn round_trip(tensors: &HashMap<&str, Tensor>) -> Vec<u8> {
        let prepared = prepare_with(tensors, &BTreeMap::new()).unwrap();
        let mut bytes = Vec::new();
        prepared.write(&mut bytes).unwrap();
        assert_eq!(bytes.len() as u64, prepared.len);
        bytes
    }

    fn sample() -> HashMap<&'static str, Tensor> {
        let cpu = Device::Cpu;
        let w = Tensor::arange(0f32, 12., &cpu)
            .unwrap()
            .reshape((3, 4))
            .unwrap();
        HashMap::from([
            ("l1.weight", w.t().unwrap()),
            ("l1.bias", Tensor::new(&[1f32, -2., 3.], &cpu).unwrap()),
            ("steps", Tensor::new(&[7i64, 9], &cpu).unwrap()),
            (
                "half \"quoted\"",
                Tensor::ones(5, DType::BF16, &cpu).unwrap(),
            ),
            ("empty", Tensor::zeros(0, DType::F16, &cpu).unwrap()),
        ])
    }

    #[test]
    fn a_written_file_reads_back_in_candle_and_here() {
        let tensors = sample();
        let bytes = round_trip(&tensors);
        let path = Path::new("memory");
        let back = parse(&bytes, path).unwrap();
        let theirs = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).unwrap();
        for (name, t) in &tensors {
            for read in [&back[*name], &theirs[*name]] {
                assert_eq!(read.dtype(), t.dtype(), "{name}");
                assert_eq!(read.dims(), t.dims(), "{name}");
                let (a, b) = (read.flatten_all().unwrap(), t.flatten_all().unwrap());
                let (a, b) = (
                    a.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap(),
                    b.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap(),
                );
                assert_eq!(a, b, "{name}");
            }
        }
    }

    #[test]
    fn a_flipped_data_bit_or_a_changed_dtype_names_the_tensor_and_loads_nothing() {
        let tensors = HashMap::from([(
            "bias",
            Tensor::new(&[0.5f32, 1.5, -2.5], &Device::Cpu).unwrap(),
        )]);
        let bytes = round_trip(&tensors);
        let path = Path::new("ckpt.safetensors");
        let mut flipped = bytes.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x10;
        let err = parse(&flipped, path).unwrap_err().to_string();
        assert!(err.contains("`bias` does not match the checksum"), "{err}");
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header = String::from_utf8(bytes[8..8 + header_len].to_vec()).unwrap();
        let changed = header.replace("\"F32\"", "\"I32\"");
        assert_ne!(changed, header);
        let mut retyped = bytes[..8].to_vec();
        retyped.extend(changed.as_bytes());
        retyped.extend(&bytes[8 + header_len..]);
        let err = parse(&retyped, path).unwrap_err().to_string();
        assert!(
            err.contains("`bias` does not match") && err.contains("I32"),
            "{err}"
        );
        // A file of another program (no checksums) still reads.
        let plain = safetensors::serialize([("bias", &tensors["bias"])], None).unwrap();
        assert_eq!(parse(&plain, path).unwrap()["bias"].dims(), [3]);
    }
}
