//! Tensors as host buffers for the host-memory backends (TCP, in-process).
//!
//! The host backend (`Backend::Tcp`) moves raw little-endian bytes between machines.
//! [`HostBuf`] holds a tensor's elements on the host in their own dtype and reduces received
//! bytes into them, with the arithmetic of [`reduce_op`](crate::distributed::reduce_op).

use crate::distributed::reduce_op::{check_dtype, Element, ReduceOp};
use crate::error::Result;
use candle_core::{CpuStorage, DType, Device, Shape, Storage, Tensor};
use half::{bf16, f16};
use std::ops::Range;

// The wire format is the in-memory format: every supported host is little-endian.
const _: () = assert!(
    cfg!(target_endian = "little"),
    "candle-parallel needs a little-endian host"
);

/// Reduces `src` (little-endian elements) into `dst` with `op`.
fn reduce_into<T: Element>(dst: &mut [T], src: &[u8], op: ReduceOp) {
    debug_assert_eq!(dst.len() * T::SIZE, src.len());
    // One loop per op so that each is a tight, vectorisable loop.
    macro_rules! lp {
        ($f:expr) => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(T::SIZE)) {
                *d = $f(*d, T::from_le(s));
            }
        };
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => lp!(|a, b| T::combine(ReduceOp::Sum, a, b)),
        ReduceOp::Product => lp!(|a, b| T::combine(ReduceOp::Product, a, b)),
        ReduceOp::Max => lp!(|a, b| T::combine(ReduceOp::Max, a, b)),
        ReduceOp::Min => lp!(|a, b| T::combine(ReduceOp::Min, a, b)),
    }
}

/// Writes `op(a, b)` of the little-endian elements `a` and `b` into `dst`.
fn reduce_pair_into<T: Element>(dst: &mut [T], a: &[u8], b: &[u8], op: ReduceOp) {
    debug_assert_eq!(a.len(), b.len());
    macro_rules! lp {
        ($f:expr) => {
            for ((d, x), y) in dst
                .iter_mut()
                .zip(a.chunks_exact(T::SIZE))
                .zip(b.chunks_exact(T::SIZE))
            {
                *d = $f(T::from_le(x), T::from_le(y));
            }
        };
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => lp!(|x, y| T::combine(ReduceOp::Sum, x, y)),
        ReduceOp::Product => lp!(|x, y| T::combine(ReduceOp::Product, x, y)),
        ReduceOp::Max => lp!(|x, y| T::combine(ReduceOp::Max, x, y)),
        ReduceOp::Min => lp!(|x, y| T::combine(ReduceOp::Min, x, y)),
    }
}

/// Calls `f` with the bytes of `t`'s elements (in row-major order): a view of its memory for a
/// contiguous CPU tensor, else a host copy.
pub(crate) fn with_bytes<R>(t: &Tensor, f: impl FnOnce(&[u8]) -> Result<R>) -> Result<R> {
    if t.device().is_cpu() {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
            let bytes = match cpu {
                CpuStorage::F32(v) => Some(bytes_of(&v[start..end])),
                CpuStorage::F64(v) => Some(bytes_of(&v[start..end])),
                CpuStorage::F16(v) => Some(bytes_of(&v[start..end])),
                CpuStorage::BF16(v) => Some(bytes_of(&v[start..end])),
                _ => None,
            };
            if let Some(bytes) = bytes {
                return f(bytes);
            }
        }
    }
    let host = HostBuf::from_tensor(t)?;
    f(host.bytes(0..host.len()))
}

/// Runs `f` on the elements of `t` in its own storage, for writing (under the storage's write
/// lock, as candle's in-place ops): `None`, without running `f`, unless `t` is a contiguous CPU
/// tensor of a float dtype the collectives carry that spans its whole storage (a view of part
/// of a larger buffer, whose other parts may still be read meanwhile, is left alone). The
/// caller must own `t`: nothing else may read it until `f` is done.
pub(crate) fn with_slice_mut<R>(
    t: &Tensor,
    f: impl FnOnce(&mut HostSlice<'_>) -> Result<R>,
) -> Result<Option<R>> {
    struct InPlace<F, R> {
        f: std::cell::RefCell<Option<F>>,
        out: std::cell::RefCell<Option<Result<R>>>,
    }
    impl<F: FnOnce(&mut HostSlice<'_>) -> Result<R>, R> candle_core::InplaceOp1 for InPlace<F, R> {
        fn name(&self) -> &'static str {
            "host-slice"
        }

        fn cpu_fwd(&self, s: &mut CpuStorage, l: &candle_core::Layout) -> candle_core::Result<()> {
            let len = match s {
                CpuStorage::F32(v) => v.len(),
                CpuStorage::F64(v) => v.len(),
                CpuStorage::F16(v) => v.len(),
                CpuStorage::BF16(v) => v.len(),
                _ => return Ok(()),
            };
            let Some((start, end)) = l.contiguous_offsets().filter(|&r| r == (0, len)) else {
                return Ok(());
            };
            let mut slice = match s {
                CpuStorage::F32(v) => HostSlice::F32(&mut v[start..end]),
                CpuStorage::F64(v) => HostSlice::F64(&mut v[start..end]),
                CpuStorage::F16(v) => HostSlice::F16(&mut v[start..end]),
                CpuStorage::BF16(v) => HostSlice::BF16(&mut v[start..end]),
                _ => return Ok(()),
            };
            if let Some(f) = self.f.borrow_mut().take() {
                *self.out.borrow_mut() = Some(f(&mut slice));
            }
            Ok(())
        }
    }
    if !t.device().is_cpu() || !t.is_contiguous() {
        return Ok(None);
    }
    let op = InPlace {
        f: std::cell::RefCell::new(Some(f)),
        out: std::cell::RefCell::new(None),
    };
    t.inplace_op1(&op)?;
    op.out.into_inner().transpose()
}

/// Asks the kernel to back large, not yet touched buffers with huge pages: a 64 MiB collective
/// output then takes 32 page faults instead of 16384, which on a small machine is a fifth of
/// the time of the collective. Only advice: nothing changes where it is not followed.
fn advise_huge_pages(bytes: &[u8]) {
    const HUGE: usize = 2 << 20;
    #[cfg(target_os = "linux")]
    if bytes.len() >= 4 * HUGE {
        let start = (bytes.as_ptr() as usize).next_multiple_of(HUGE);
        let end = (bytes.as_ptr() as usize + bytes.len()) / HUGE * HUGE;
        if end > start {
            // SAFETY: madvise only changes how the kernel backs this range of our own
            // allocation; it never changes the memory's contents or validity.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (bytes, HUGE);
}

/// Whether point-to-point messages carry `dtype`: every dtype with a whole number of bytes per
/// element (all but candle's packed sub-byte float formats).
pub(crate) fn check_raw_dtype(dtype: DType) -> Result<()> {
    match dtype {
        DType::U8
        | DType::U32
        | DType::I16
        | DType::I32
        | DType::I64
        | DType::BF16
        | DType::F16
        | DType::F32
        | DType::F64 => Ok(()),
        other => Err(crate::error::Error::InvalidArgument {
            what: "tensor dtype",
            detail: format!(
                "{} tensors cannot be sent; convert to one of u8, u32, i16, i32, i64, bf16, \
                 f16, f32, f64 first",
                other.as_str()
            ),
        }),
    }
}

/// Integers that are plain old data: every byte initialised, no padding.
trait PlainInt: Copy + candle_core::WithDType {}
impl PlainInt for u8 {}
impl PlainInt for u32 {}
impl PlainInt for i16 {}
impl PlainInt for i32 {}
impl PlainInt for i64 {}

/// The bytes of a slice of plain integers.
fn int_bytes<T: PlainInt>(xs: &[T]) -> &[u8] {
    // SAFETY: `PlainInt` is only implemented for primitive integers: no padding, every byte
    // initialised; u8 has no alignment requirement.
    unsafe { std::slice::from_raw_parts(xs.as_ptr().cast::<u8>(), std::mem::size_of_val(xs)) }
}

/// Calls `f` with the bytes of `t`'s elements in row-major order, for any dtype that
/// [`check_raw_dtype`] accepts: floats as [`with_bytes`] gives them (in place when it can),
/// integers through a host copy.
pub(crate) fn with_raw_bytes<R>(t: &Tensor, f: impl FnOnce(&[u8]) -> Result<R>) -> Result<R> {
    check_raw_dtype(t.dtype())?;
    fn ints<T: PlainInt, R>(t: &Tensor, f: impl FnOnce(&[u8]) -> Result<R>) -> Result<R> {
        f(int_bytes(&t.flatten_all()?.to_vec1::<T>()?))
    }
    match t.dtype() {
        DType::U8 => ints::<u8, R>(t, f),
        DType::U32 => ints::<u32, R>(t, f),
        DType::I16 => ints::<i16, R>(t, f),
        DType::I32 => ints::<i32, R>(t, f),
        DType::I64 => ints::<i64, R>(t, f),
        _ => with_bytes(t, f),
    }
}

/// The bytes of a slice of plain floats.
fn bytes_of<T: Element>(xs: &[T]) -> &[u8] {
    // SAFETY: `Element` is only implemented for f32, f64, f16 and bf16: plain old data without
    // padding, for which every byte is initialised; u8 has no alignment requirement.
    unsafe { std::slice::from_raw_parts(xs.as_ptr().cast::<u8>(), std::mem::size_of_val(xs)) }
}

/// The bytes of a mutable slice of plain floats.
fn bytes_of_mut<T: Element>(xs: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `bytes_of`; also every bit pattern is a valid value of these float types,
    // so writing arbitrary bytes cannot create an invalid value.
    unsafe {
        std::slice::from_raw_parts_mut(xs.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(xs))
    }
}

/// A tensor's elements on the host.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum HostBuf {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

macro_rules! dispatch {
    ($self:expr, $v:ident => $body:expr) => {
        match $self {
            HostBuf::F32($v) => $body,
            HostBuf::F64($v) => $body,
            HostBuf::F16($v) => $body,
            HostBuf::BF16($v) => $body,
        }
    };
}

impl HostBuf {
    /// Copies the elements of `t` (any layout, any device) to the host.
    pub fn from_tensor(t: &Tensor) -> Result<Self> {
        check_dtype(t.dtype())?;
        let flat = t.flatten_all()?;
        Ok(match t.dtype() {
            DType::F64 => Self::F64(flat.to_vec1()?),
            DType::F16 => Self::F16(flat.to_vec1()?),
            DType::BF16 => Self::BF16(flat.to_vec1()?),
            _ => Self::F32(flat.to_vec1()?),
        })
    }

    /// An all-zero buffer of `len` elements of `dtype` (a float dtype). Large buffers come
    /// from the allocator's zeroed pages, so their memory is only touched when written.
    pub fn zeros(dtype: DType, len: usize) -> Self {
        let buf = match dtype {
            DType::F64 => Self::F64(vec![0.0; len]),
            DType::F16 => Self::F16(vec![f16::ZERO; len]),
            DType::BF16 => Self::BF16(vec![bf16::ZERO; len]),
            _ => Self::F32(vec![0.0; len]),
        };
        dispatch!(&buf, v => advise_huge_pages(bytes_of(v)));
        buf
    }

    /// The elements of `ts` (all of `ts[0]`'s dtype), one tensor after the other.
    pub fn concat(ts: &[Tensor]) -> Result<Self> {
        let dtype = ts.first().map_or(DType::F32, Tensor::dtype);
        check_dtype(dtype)?;
        let total = ts.iter().map(Tensor::elem_count).sum();
        let mut buf = Self::zeros(dtype, total);
        let mut offset = 0;
        for t in ts {
            let n = t.elem_count();
            with_bytes(t, |bytes| {
                buf.bytes_mut(offset..offset + n).copy_from_slice(bytes);
                Ok(())
            })?;
            offset += n;
        }
        Ok(buf)
    }

    /// A tensor of `shape` on `device` holding these elements.
    pub fn into_tensor(self, shape: &Shape, device: &Device) -> Result<Tensor> {
        let t = dispatch!(self, v => Tensor::from_vec(v, shape, &Device::Cpu)?);
        Ok(t.to_device(device)?)
    }

    pub fn len(&self) -> usize {
        dispatch!(self, v => v.len())
    }

    pub fn elem_size(&self) -> usize {
        match self {
            Self::F32(_) => 4,
            Self::F64(_) => 8,
            Self::F16(_) | Self::BF16(_) => 2,
        }
    }

    /// The bytes of elements `range`.
    pub fn bytes(&self, range: Range<usize>) -> &[u8] {
        dispatch!(self, v => bytes_of(&v[range]))
    }

    /// The bytes of elements `range`, for writing.
    pub fn bytes_mut(&mut self, range: Range<usize>) -> &mut [u8] {
        dispatch!(self, v => bytes_of_mut(&mut v[range]))
    }

    /// The elements, borrowed for writing: what the ring algorithms work on.
    pub fn view(&mut self) -> HostSlice<'_> {
        match self {
            Self::F32(v) => HostSlice::F32(v),
            Self::F64(v) => HostSlice::F64(v),
            Self::F16(v) => HostSlice::F16(v),
            Self::BF16(v) => HostSlice::BF16(v),
        }
    }

    /// Reduces the little-endian elements in `src` into elements `range`.
    pub fn reduce_from(&mut self, range: Range<usize>, src: &[u8], op: ReduceOp) {
        self.view().reduce_from(range, src, op)
    }

    /// Divides every element by the number of ranks `n` (the last step of an average).
    pub fn divide(&mut self, n: usize) {
        let mut all = self.view();
        all.divide_range(0..all.len(), n)
    }

    /// Elements `range` as a new buffer.
    pub fn slice(&self, range: Range<usize>) -> Self {
        match self {
            Self::F32(v) => Self::F32(v[range].to_vec()),
            Self::F64(v) => Self::F64(v[range].to_vec()),
            Self::F16(v) => Self::F16(v[range].to_vec()),
            Self::BF16(v) => Self::BF16(v[range].to_vec()),
        }
    }
}

/// Elements on the host, borrowed for writing: a [`HostBuf`]'s, or a CPU tensor's own storage
/// (an all-reduce in place in the tensor).
pub(crate) enum HostSlice<'a> {
    F32(&'a mut [f32]),
    F64(&'a mut [f64]),
    F16(&'a mut [f16]),
    BF16(&'a mut [bf16]),
}

macro_rules! dispatch_slice {
    ($self:expr, $v:ident => $body:expr) => {
        match $self {
            HostSlice::F32($v) => $body,
            HostSlice::F64($v) => $body,
            HostSlice::F16($v) => $body,
            HostSlice::BF16($v) => $body,
        }
    };
}

impl HostSlice<'_> {
    pub fn len(&self) -> usize {
        dispatch_slice!(self, v => v.len())
    }

    pub fn elem_size(&self) -> usize {
        match self {
            Self::F32(_) => 4,
            Self::F64(_) => 8,
            Self::F16(_) | Self::BF16(_) => 2,
        }
    }

    /// The bytes of elements `range`.
    pub fn bytes(&self, range: Range<usize>) -> &[u8] {
        dispatch_slice!(self, v => bytes_of(&v[range]))
    }

    /// The bytes of elements `range`, for writing.
    pub fn bytes_mut(&mut self, range: Range<usize>) -> &mut [u8] {
        dispatch_slice!(self, v => bytes_of_mut(&mut v[range]))
    }

    /// Reduces the little-endian elements in `src` into elements `range`.
    pub fn reduce_from(&mut self, range: Range<usize>, src: &[u8], op: ReduceOp) {
        dispatch_slice!(self, v => reduce_into(&mut v[range], src, op))
    }

    /// Writes `op(a, b)` of the little-endian elements `a` and `b` into elements `range`.
    pub fn reduce_pair(&mut self, range: Range<usize>, a: &[u8], b: &[u8], op: ReduceOp) {
        dispatch_slice!(self, v => reduce_pair_into(&mut v[range], a, b, op))
    }

    /// Divides elements `range` by the number of ranks `n` (the last step of an average).
    pub fn divide_range(&mut self, range: Range<usize>, n: usize) {
        dispatch_slice!(self, v => v[range].iter_mut().for_each(|x| *x = x.average(n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_follow_the_op_and_propagate_nan() {
        let mut b = HostBuf::F32(vec![1.0, 5.0, f32::NAN, 2.0]);
        let other = HostBuf::F32(vec![3.0, 4.0, 1.0, f32::NAN]);
        let src = other.bytes(0..4).to_vec();
        let mut max = b.clone();
        max.reduce_from(0..4, &src, ReduceOp::Max);
        let HostBuf::F32(m) = max else { unreachable!() };
        assert_eq!(&m[..2], &[3.0, 5.0]);
        assert!(m[2].is_nan() && m[3].is_nan());
        b.reduce_from(0..2, &src[..8], ReduceOp::Product);
        assert_eq!(b.bytes(0..2), HostBuf::F32(vec![3.0, 20.0]).bytes(0..2));
    }

    #[test]
    fn half_types_round_trip_through_tensors() -> Result<()> {
        let t = Tensor::new(&[1.5f32, -2.0, 0.25], &Device::Cpu)?.to_dtype(DType::BF16)?;
        let mut b = HostBuf::from_tensor(&t)?;
        let twice = b.bytes(0..3).to_vec();
        b.reduce_from(0..3, &twice, ReduceOp::Sum);
        b.divide(4);
        let back = b
            .into_tensor(t.shape(), &Device::Cpu)?
            .to_dtype(DType::F32)?;
        assert_eq!(back.to_vec1::<f32>()?, [0.75, -1.0, 0.125]);
        Ok(())
    }

    #[test]
    fn integer_tensors_are_refused() {
        let t = Tensor::new(&[1u32], &Device::Cpu).unwrap();
        let err = HostBuf::from_tensor(&t).unwrap_err();
        assert!(err.to_string().contains("U32"), "{err}");
    }
}
