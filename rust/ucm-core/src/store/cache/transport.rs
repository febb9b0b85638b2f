//! Moving shard bytes between cache slots and the caller's memory.
//!
//! Two paths behind one type:
//!
//! * **Host** (always available): a copy between the slot and each of the
//!   caller's segments, with streaming stores for large ones
//!   ([`crate::io::bulk_copy`]).
//! * **CUDA** (when `device_id >= 0`, `libcudart` can be loaded at run time
//!   and the caller's addresses are device memory): asynchronous copies on
//!   the cache's own streams (`cache_stream_number`, used round-robin), then
//!   a stream synchronise, so the bytes are in place when the copy returns.
//!   The cache's data area is page-locked with `cudaHostRegister` so these
//!   are real DMA transfers. A dump first makes its stream wait on the
//!   caller's `prerequisite_handle` (a `cudaEvent_t` recorded after the
//!   kernels that produced the KV), so it never reads half-written memory.
//!
//! Dumps and loads hash the shard's bytes as they move (the checksum of
//! [`crate::store::format::layout`], which each slot carries): on the host
//! path in the same pass as the copy, each stripe hashed from the registers
//! that copy it ([`copy_xxh3_64`]); on the CUDA path from the slot's host
//! memory once the copy is done.
//!
//! The runtime is found with `dlopen` (`libcudart.so`, then versioned
//! names), so there is no link-time dependency: on a machine without CUDA
//! the host path runs and nothing else changes. Which path a transfer takes
//! is decided per call: `device_memory = auto` asks
//! `cudaPointerGetAttributes` about the first segment.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::block::MemSeg;
use crate::error::{Result, UcmError};
use crate::hashing::copy_xxh3::{copy_xxh3_64, CopyPiece};
use crate::hashing::xxh3::xxh3_64;
use crate::io::bulk_copy::bulk_copy;

/// The copies between a slot and the caller's segments, laid end to end
/// in the slot: into the slot (`into_slot`, a dump) or out of it (a load).
fn slot_pieces(slot: *mut u8, segs: &[MemSeg], into_slot: bool) -> Vec<CopyPiece> {
    let mut off = 0;
    segs.iter()
        .map(|s| {
            // Pointer arithmetic only: the callers' contracts say the
            // segments' total length fits in the slot.
            let at = slot.wrapping_add(off);
            off += s.len;
            let (dst, src) = if into_slot {
                (at, s.addr as *const u8)
            } else {
                (s.addr as *mut u8, at.cast_const())
            };
            CopyPiece {
                dst,
                src,
                len: s.len,
            }
        })
        .collect()
}

/// Whether caller addresses are device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceMemory {
    /// Ask the CUDA runtime about each transfer's first address.
    #[default]
    Auto,
    /// Always device memory (requires CUDA).
    Yes,
    /// Always host memory (never touches CUDA for copies).
    No,
}

type CudaErr = c_int;
type Stream = *mut c_void;

const CUDA_MEMCPY_DEFAULT: c_int = 4;
const CUDA_HOST_REGISTER_PORTABLE: c_uint = 1;
const CUDA_STREAM_NON_BLOCKING: c_uint = 1;
const CUDA_MEMORY_TYPE_DEVICE: c_int = 2;
const CUDA_MEMORY_TYPE_MANAGED: c_int = 3;

/// The few CUDA runtime entry points the cache uses, resolved at run time.
struct CudaRt {
    _lib: *mut c_void,
    set_device: unsafe extern "C" fn(c_int) -> CudaErr,
    get_device_count: unsafe extern "C" fn(*mut c_int) -> CudaErr,
    host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CudaErr,
    host_unregister: unsafe extern "C" fn(*mut c_void) -> CudaErr,
    stream_create: unsafe extern "C" fn(*mut Stream, c_uint) -> CudaErr,
    stream_destroy: unsafe extern "C" fn(Stream) -> CudaErr,
    stream_sync: unsafe extern "C" fn(Stream) -> CudaErr,
    stream_wait_event: unsafe extern "C" fn(Stream, *mut c_void, c_uint) -> CudaErr,
    memcpy_async: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, Stream) -> CudaErr,
    pointer_attrs: unsafe extern "C" fn(*mut c_void, *const c_void) -> CudaErr,
    get_last_error: unsafe extern "C" fn() -> CudaErr,
    error_string: unsafe extern "C" fn(CudaErr) -> *const c_char,
}

// SAFETY: the CUDA runtime API is thread-safe; the handle and function
// pointers are immutable after loading.
unsafe impl Send for CudaRt {}
// SAFETY: as above.
unsafe impl Sync for CudaRt {}

impl CudaRt {
    fn load() -> Option<CudaRt> {
        const NAMES: [&str; 4] = [
            "libcudart.so",
            "libcudart.so.12",
            "libcudart.so.13",
            "libcudart.so.11.0",
        ];
        let lib = NAMES.iter().find_map(|n| {
            let c = CString::new(*n).ok()?;
            // SAFETY: dlopen with a valid C string; a null result is handled.
            let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            (!h.is_null()).then_some(h)
        })?;
        macro_rules! sym {
            ($name:literal, $ty:ty) => {{
                let c = CString::new($name).ok()?;
                // SAFETY: `lib` is a live handle from dlopen.
                let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
                if p.is_null() {
                    log::warn!("libcudart has no symbol {}; CUDA copies disabled", $name);
                    return None;
                }
                // SAFETY: the symbol is the CUDA runtime function of that
                // name, whose C signature matches the field's type.
                unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
            }};
        }
        Some(CudaRt {
            _lib: lib,
            set_device: sym!("cudaSetDevice", unsafe extern "C" fn(c_int) -> CudaErr),
            get_device_count: sym!(
                "cudaGetDeviceCount",
                unsafe extern "C" fn(*mut c_int) -> CudaErr
            ),
            host_register: sym!(
                "cudaHostRegister",
                unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CudaErr
            ),
            host_unregister: sym!(
                "cudaHostUnregister",
                unsafe extern "C" fn(*mut c_void) -> CudaErr
            ),
            stream_create: sym!(
                "cudaStreamCreateWithFlags",
                unsafe extern "C" fn(*mut Stream, c_uint) -> CudaErr
            ),
            stream_destroy: sym!("cudaStreamDestroy", unsafe extern "C" fn(Stream) -> CudaErr),
            stream_sync: sym!(
                "cudaStreamSynchronize",
                unsafe extern "C" fn(Stream) -> CudaErr
            ),
            stream_wait_event: sym!(
                "cudaStreamWaitEvent",
                unsafe extern "C" fn(Stream, *mut c_void, c_uint) -> CudaErr
            ),
            memcpy_async: sym!(
                "cudaMemcpyAsync",
                unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, Stream) -> CudaErr
            ),
            pointer_attrs: sym!(
                "cudaPointerGetAttributes",
                unsafe extern "C" fn(*mut c_void, *const c_void) -> CudaErr
            ),
            get_last_error: sym!("cudaGetLastError", unsafe extern "C" fn() -> CudaErr),
            error_string: sym!(
                "cudaGetErrorString",
                unsafe extern "C" fn(CudaErr) -> *const c_char
            ),
        })
    }

    fn check(&self, what: &str, rc: CudaErr) -> Result<()> {
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: cudaGetErrorString returns a static NUL-terminated string.
        let msg = unsafe { CStr::from_ptr((self.error_string)(rc)) }
            .to_string_lossy()
            .into_owned();
        Err(UcmError::TaskFailed(format!(
            "{what}: CUDA error {rc}: {msg}"
        )))
    }
}

struct CudaPath {
    rt: CudaRt,
    device: c_int,
    streams: Vec<usize>,
    next: AtomicUsize,
    registered: Option<(usize, usize)>,
}

/// Copies between slots and caller memory (see the module docs).
pub struct Transport {
    cuda: Option<CudaPath>,
    mode: DeviceMemory,
}

impl Transport {
    /// Sets up the path for `device_id`. `area` is the cache's data area,
    /// page-locked when CUDA is used.
    pub fn new(
        device_id: i64,
        mode: DeviceMemory,
        streams: usize,
        area: (*mut u8, usize),
    ) -> Result<Self> {
        if device_id < 0 || mode == DeviceMemory::No {
            return Ok(Transport { cuda: None, mode });
        }
        let Some(rt) = CudaRt::load() else {
            if mode == DeviceMemory::Yes {
                return Err(UcmError::Unsupported(
                    "device_memory is true but the CUDA runtime (libcudart.so) was not found"
                        .into(),
                ));
            }
            log::debug!("CUDA runtime not found; the cache copies host memory with memcpy");
            return Ok(Transport { cuda: None, mode });
        };
        let mut count: c_int = 0;
        // SAFETY: valid out-pointer.
        let rc = unsafe { (rt.get_device_count)(&mut count) };
        if rc != 0 || i64::from(count) <= device_id {
            // SAFETY: clears the sticky error of the failed call.
            unsafe { (rt.get_last_error)() };
            if mode == DeviceMemory::Yes {
                return Err(UcmError::invalid(format!(
                    "device_id: {device_id} but CUDA reports {count} device(s)"
                )));
            }
            log::info!("no CUDA device {device_id}; the cache copies host memory with memcpy");
            return Ok(Transport { cuda: None, mode });
        }
        let device = device_id as c_int;
        // SAFETY: plain runtime calls with valid arguments.
        rt.check("cudaSetDevice", unsafe { (rt.set_device)(device) })?;
        let mut path = CudaPath {
            rt,
            device,
            streams: Vec::new(),
            next: AtomicUsize::new(0),
            registered: None,
        };
        for _ in 0..streams.clamp(1, 32) {
            let mut s: Stream = std::ptr::null_mut();
            // SAFETY: valid out-pointer.
            let rc = unsafe { (path.rt.stream_create)(&mut s, CUDA_STREAM_NON_BLOCKING) };
            path.rt.check("cudaStreamCreateWithFlags", rc)?;
            path.streams.push(s as usize);
        }
        if area.1 > 0 {
            // SAFETY: `area` is a live mapping owned by the cache, which
            // outlives the transport (dropped first, unregistering it).
            let rc = unsafe {
                (path.rt.host_register)(area.0.cast(), area.1, CUDA_HOST_REGISTER_PORTABLE)
            };
            if rc == 0 {
                path.registered = Some((area.0 as usize, area.1));
            } else {
                // Still correct, only slower (staged by the driver).
                // SAFETY: clears the sticky error.
                unsafe { (path.rt.get_last_error)() };
                log::warn!(
                    "cudaHostRegister of {} bytes failed (error {rc}); cache copies will be pageable",
                    area.1
                );
            }
        }
        log::info!(
            "cache transport: CUDA device {device_id}, {} stream(s), page-locked: {}",
            path.streams.len(),
            path.registered.is_some()
        );
        Ok(Transport {
            cuda: Some(path),
            mode,
        })
    }

    /// True when the CUDA path is set up.
    pub fn has_cuda(&self) -> bool {
        self.cuda.is_some()
    }

    /// True when `segs` are host memory, copied with `memcpy`.
    pub fn is_host(&self, segs: &[MemSeg]) -> bool {
        self.device_path(segs).is_none()
    }

    fn device_path(&self, segs: &[MemSeg]) -> Option<&CudaPath> {
        let cuda = self.cuda.as_ref()?;
        match self.mode {
            DeviceMemory::No => None,
            DeviceMemory::Yes => Some(cuda),
            DeviceMemory::Auto => {
                let first = segs.first()?;
                // cudaPointerAttributes (CUDA >= 11): type, device, two
                // pointers; oversized so an older, longer layout also fits.
                let mut attrs = [0u64; 8];
                // SAFETY: `attrs` is larger than the struct the call writes.
                let rc = unsafe {
                    (cuda.rt.pointer_attrs)(attrs.as_mut_ptr().cast(), first.addr as *const c_void)
                };
                if rc != 0 {
                    // Older runtimes fail on plain host pointers.
                    // SAFETY: clears the sticky error.
                    unsafe { (cuda.rt.get_last_error)() };
                    return None;
                }
                let kind = attrs[0] as u32 as c_int;
                matches!(kind, CUDA_MEMORY_TYPE_DEVICE | CUDA_MEMORY_TYPE_MANAGED).then_some(cuda)
            }
        }
    }

    /// Copies caller memory `segs` into `slot` (a dump). `prerequisite` is
    /// a CUDA event to wait for first (0 = none; ignored on the host path,
    /// where the caller's memory is complete when it calls).
    ///
    /// # Safety
    /// `slot` points to at least the segments' total length of writable
    /// memory that nobody else accesses; every segment is valid to read.
    pub unsafe fn copy_in(&self, slot: *mut u8, segs: &[MemSeg], prerequisite: u64) -> Result<()> {
        if let Some(cuda) = self.device_path(segs) {
            // SAFETY: forwarded caller contract.
            return unsafe { cuda.copy(slot, segs, prerequisite, true) };
        }
        let mut off = 0;
        for s in segs {
            // SAFETY: per the contract, source valid for s.len bytes and the
            // destination range lies inside the slot.
            unsafe { bulk_copy(slot.add(off), s.addr as *const u8, s.len) };
            off += s.len;
        }
        Ok(())
    }

    /// [`Self::copy_in`], returning the checksum of the bytes copied,
    /// computed from them as they are written to the slot (host path) or
    /// from the slot right after the device copy (CUDA path).
    ///
    /// # Safety
    /// As for [`Self::copy_in`].
    pub unsafe fn copy_in_summed(
        &self,
        slot: *mut u8,
        segs: &[MemSeg],
        prerequisite: u64,
    ) -> Result<u64> {
        if let Some(cuda) = self.device_path(segs) {
            let len = segs.iter().map(|s| s.len).sum();
            // SAFETY: forwarded caller contract; the copy is complete when
            // it returns, and the slot is ours alone.
            unsafe {
                cuda.copy(slot, segs, prerequisite, true)?;
                return Ok(xxh3_64(std::slice::from_raw_parts(slot, len)));
            }
        }
        // SAFETY: per the contract, each source is valid for its length and
        // the destinations are disjoint ranges of the slot, ours alone.
        Ok(unsafe { copy_xxh3_64(&slot_pieces(slot, segs, true)) })
    }

    /// [`Self::copy_out`], returning the checksum of the slot's bytes as
    /// copied (hashed in the same pass on the host, after the device copy
    /// on the CUDA path), for the caller to check before it trusts them.
    ///
    /// # Safety
    /// As for [`Self::copy_out`].
    pub unsafe fn copy_out_summed(&self, slot: *const u8, segs: &[MemSeg]) -> Result<u64> {
        if let Some(cuda) = self.device_path(segs) {
            let len = segs.iter().map(|s| s.len).sum();
            // SAFETY: forwarded caller contract.
            unsafe {
                cuda.copy(slot as *mut u8, segs, 0, false)?;
                return Ok(xxh3_64(std::slice::from_raw_parts(slot, len)));
            }
        }
        // SAFETY: per the contract: the slot's bytes are nobody's to write
        // meanwhile and every segment is the caller's to write.
        Ok(unsafe { copy_xxh3_64(&slot_pieces(slot.cast_mut(), segs, false)) })
    }

    /// Copies `slot` out into caller memory `segs` (a load).
    ///
    /// # Safety
    /// `slot` holds at least the segments' total length of bytes nobody
    /// writes meanwhile; every segment is valid to write.
    pub unsafe fn copy_out(&self, slot: *const u8, segs: &[MemSeg]) -> Result<()> {
        if let Some(cuda) = self.device_path(segs) {
            // SAFETY: forwarded caller contract.
            return unsafe { cuda.copy(slot as *mut u8, segs, 0, false) };
        }
        let mut off = 0;
        for s in segs {
            // SAFETY: per the contract.
            unsafe { bulk_copy(s.addr as *mut u8, slot.add(off), s.len) };
            off += s.len;
        }
        Ok(())
    }
}

impl CudaPath {
    /// # Safety
    /// As for [`Transport::copy_in`] / [`Transport::copy_out`].
    unsafe fn copy(&self, slot: *mut u8, segs: &[MemSeg], event: u64, to_slot: bool) -> Result<()> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.streams.len();
        let stream = self.streams[i] as Stream;
        // The current device is per thread; copy threads may serve any cache.
        // SAFETY: plain runtime calls on handles we created; pointers per
        // the caller's contract.
        unsafe {
            self.rt
                .check("cudaSetDevice", (self.rt.set_device)(self.device))?;
            if event != 0 && to_slot {
                self.rt.check(
                    "cudaStreamWaitEvent(prerequisite_handle)",
                    (self.rt.stream_wait_event)(stream, event as *mut c_void, 0),
                )?;
            }
            let mut off = 0;
            for s in segs {
                let (dst, src) = if to_slot {
                    (slot.add(off).cast::<c_void>(), s.addr as *const c_void)
                } else {
                    (s.addr as *mut c_void, slot.add(off) as *const c_void)
                };
                self.rt.check(
                    "cudaMemcpyAsync",
                    (self.rt.memcpy_async)(dst, src, s.len, CUDA_MEMCPY_DEFAULT, stream),
                )?;
                off += s.len;
            }
            self.rt
                .check("cudaStreamSynchronize", (self.rt.stream_sync)(stream))
        }
    }
}

impl Drop for CudaPath {
    fn drop(&mut self) {
        // SAFETY: handles we created; the registered range is still mapped
        // (the cache drops its transport before its table).
        unsafe {
            (self.rt.set_device)(self.device);
            for &s in &self.streams {
                (self.rt.stream_sync)(s as Stream);
                (self.rt.stream_destroy)(s as Stream);
            }
            if let Some((p, _)) = self.registered {
                (self.rt.host_unregister)(p as *mut c_void);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_path_round_trips() {
        let t = Transport::new(0, DeviceMemory::Auto, 2, (std::ptr::null_mut(), 0)).unwrap();
        let a = [1u8; 100];
        let b = [2u8; 28];
        let mut slot = vec![0u8; 128];
        let segs = [MemSeg::of(&a), MemSeg::of(&b)];
        // SAFETY: all buffers are live and sized as described.
        unsafe { t.copy_in(slot.as_mut_ptr(), &segs, 0).unwrap() };
        assert_eq!(&slot[..100], &a[..]);
        assert_eq!(&slot[100..], &b[..]);
        let mut c = vec![0u8; 128];
        let out = [MemSeg::of_mut(&mut c)];
        // SAFETY: as above.
        unsafe { t.copy_out(slot.as_ptr(), &out).unwrap() };
        assert_eq!(c, slot);
    }

    /// The checksums of copies in and out are the block format's
    /// (xxh3-64 of the shard's bytes), whatever the segments and however
    /// many pieces the copy takes.
    #[test]
    fn summed_copies_return_the_shard_checksum() {
        let t = Transport::new(0, DeviceMemory::No, 1, (std::ptr::null_mut(), 0)).unwrap();
        let len = 3 * (64 << 10) + 12345;
        let src: Vec<u8> = (0..len).map(|i| (i * 31 + i / 977) as u8).collect();
        let (a, b) = src.split_at((64 << 10) + 7);
        let mut slot = vec![0u8; len];
        // SAFETY: all buffers are live and sized as described.
        let sum = unsafe {
            t.copy_in_summed(slot.as_mut_ptr(), &[MemSeg::of(a), MemSeg::of(b)], 0)
                .unwrap()
        };
        assert_eq!(slot, src);
        assert_eq!(sum, xxh3_64(&src));
        let mut out = vec![0u8; len];
        // SAFETY: as above.
        let back = unsafe {
            t.copy_out_summed(slot.as_ptr(), &[MemSeg::of_mut(&mut out)])
                .unwrap()
        };
        assert_eq!((back, &out), (sum, &src));
        slot[len / 2] ^= 1;
        // SAFETY: as above.
        let flipped = unsafe {
            t.copy_out_summed(slot.as_ptr(), &[MemSeg::of_mut(&mut out)])
                .unwrap()
        };
        assert_ne!(flipped, sum, "a flipped byte changes the checksum");
    }
}
