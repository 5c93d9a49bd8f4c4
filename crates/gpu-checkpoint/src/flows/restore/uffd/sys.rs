//! The raw userfaultfd interface (linux/userfaultfd.h): the ioctls' argument structs and the few calls the
//! restore makes with them. Generic kernel knowledge, kept apart from what the restore does with it.
//!
//! Why our own ~150 lines instead of the `userfaultfd` crate: that crate does cover what we use (the API
//! handshake, registration, `UFFDIO_COPY` with its mode, `UFFDIO_ZEROPAGE`, reading events), but its
//! `userfaultfd-sys` generates the bindings at build time with bindgen (libclang and the kernel headers on
//! every build machine) and compiles C, and it brings a second nix (0.27) and thiserror (1) into the build.
//! We use four ioctls on descriptors CRIU opened; nix's ioctl macros (already a dependency) derive each
//! request code from its struct, and the compile-time checks below pin every struct to the header's layout
//! and every request code to the header's value.

use std::mem::size_of;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;

/// `UFFD_API`: the API version `UFFDIO_API` negotiates.
const UFFD_API: u64 = 0xAA;
/// The ioctl type of every userfaultfd request (`UFFDIO`).
const UFFDIO: u8 = 0xAA;

/// `struct uffdio_api`.
#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

/// `struct uffdio_copy`.
#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    /// Bytes copied, or a negative errno.
    copy: i64,
}

/// `struct uffdio_zeropage` (its `struct uffdio_range` flattened: start, len).
#[repr(C)]
struct UffdioZeropage {
    start: u64,
    len: u64,
    mode: u64,
    zeropage: i64,
}

/// `struct uffdio_register` (its `struct uffdio_range` flattened). Only tests register memory themselves:
/// on restore CRIU does.
#[cfg(test)]
#[repr(C)]
struct UffdioRegister {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}

/// `struct uffd_msg`: the event, then its arguments.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct UffdMsg {
    pub(super) event: u8,
    _reserved: [u8; 7],
    /// For a page fault: flags, address, thread id.
    pub(super) arg: [u64; 3],
}

/// `UFFD_EVENT_PAGEFAULT`.
pub(super) const UFFD_EVENT_PAGEFAULT: u8 = 0x12;

// The layouts of linux/userfaultfd.h: a struct of another size would be a different request code, or have
// the kernel read and write past ours.
const _: () = assert!(size_of::<UffdioApi>() == 24);
const _: () = assert!(size_of::<UffdioCopy>() == 40);
const _: () = assert!(size_of::<UffdioZeropage>() == 32);
#[cfg(test)]
const _: () = assert!(size_of::<UffdioRegister>() == 32);
const _: () = assert!(size_of::<UffdMsg>() == 32);
// The request codes the header defines (`_IOWR(UFFDIO, nr, struct)`).
const _: () =
    assert!(nix::request_code_readwrite!(UFFDIO, 0x3F, size_of::<UffdioApi>()) == 0xC018_AA3F);
const _: () =
    assert!(nix::request_code_readwrite!(UFFDIO, 0x03, size_of::<UffdioCopy>()) == 0xC028_AA03);
const _: () =
    assert!(nix::request_code_readwrite!(UFFDIO, 0x04, size_of::<UffdioZeropage>()) == 0xC020_AA04);
#[cfg(test)]
const _: () =
    assert!(nix::request_code_readwrite!(UFFDIO, 0x00, size_of::<UffdioRegister>()) == 0xC020_AA00);

nix::ioctl_readwrite!(
    /// `UFFDIO_API`.
    uffdio_api,
    UFFDIO,
    0x3F,
    UffdioApi
);
nix::ioctl_readwrite!(
    /// `UFFDIO_COPY`.
    uffdio_copy,
    UFFDIO,
    0x03,
    UffdioCopy
);
nix::ioctl_readwrite!(
    /// `UFFDIO_ZEROPAGE`.
    uffdio_zeropage,
    UFFDIO,
    0x04,
    UffdioZeropage
);
nix::ioctl_readwrite!(
    /// `UFFDIO_REGISTER`.
    #[cfg(test)]
    uffdio_register,
    UFFDIO,
    0x00,
    UffdioRegister
);

pub(super) fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as u64
    } else {
        4096
    }
}

/// A new userfaultfd (`flags`: `O_CLOEXEC`, `O_NONBLOCK`); [`handshake`] comes next.
pub(super) fn open(flags: libc::c_int) -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscall; a descriptor it returns is owned below.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the descriptor was just opened and nothing else owns it; it closes on drop.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// The `UFFDIO_API` handshake on a new userfaultfd, asking for no feature.
pub(super) fn handshake(uffd: RawFd) -> std::io::Result<()> {
    let mut api = UffdioApi {
        api: UFFD_API,
        features: 0,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API with a valid struct on the caller's descriptor.
    unsafe { uffdio_api(uffd, &mut api) }?;
    Ok(())
}

/// `UFFDIO_COPY` of `src` to `dst` (page-aligned, whole pages), resumed after partial copies.
pub(super) fn copy(uffd: RawFd, dst: u64, src: &[u8]) -> std::io::Result<()> {
    let len = src.len() as u64;
    let mut done = 0u64;
    while done < len {
        let mut c = UffdioCopy {
            dst: dst + done,
            src: src.as_ptr() as u64 + done,
            len: len - done,
            mode: 0,
            copy: 0,
        };
        // SAFETY: UFFDIO_COPY reads `len - done` bytes at `src + done`, which `src` holds, and writes
        // the kernel's result into `c`.
        let r = unsafe { uffdio_copy(uffd, &mut c) };
        if c.copy > 0 {
            done += c.copy as u64;
        }
        match r {
            Ok(_) => {}
            // Partly done (the part is counted above), or the mappings changed under the copy: go on.
            Err(Errno::EAGAIN) => {}
            // A page that is there already (served during the restore, or by a second fault): skip.
            Err(Errno::EEXIST) => done += page_size(),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// `UFFDIO_ZEROPAGE` of `len` bytes at `addr`.
pub(super) fn zeropage(uffd: RawFd, addr: u64, len: u64) -> std::io::Result<()> {
    let mut z = UffdioZeropage {
        start: addr,
        len,
        mode: 0,
        zeropage: 0,
    };
    // SAFETY: UFFDIO_ZEROPAGE with a valid struct; the kernel writes its result into `z`.
    unsafe { uffdio_zeropage(uffd, &mut z) }?;
    Ok(())
}

/// The next event queued on `uffd` (opened non-blocking), or `None` when there is none.
pub(super) fn read_event(uffd: RawFd) -> std::io::Result<Option<UffdMsg>> {
    loop {
        let mut msg = UffdMsg {
            event: 0,
            _reserved: [0; 7],
            arg: [0; 3],
        };
        let size = size_of::<UffdMsg>();
        // SAFETY: reading at most `size` bytes into `msg`, a plain-old-data struct of that size.
        let n = unsafe { libc::read(uffd, (&mut msg as *mut UffdMsg).cast(), size) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                std::io::ErrorKind::WouldBlock => Ok(None),
                std::io::ErrorKind::Interrupted => continue,
                _ => Err(e),
            };
        }
        if n as usize != size {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("short userfaultfd message ({n} bytes)"),
            ));
        }
        return Ok(Some(msg));
    }
}

/// Registers `len` bytes at `start` for missing-page faults (`UFFDIO_REGISTER_MODE_MISSING`).
#[cfg(test)]
pub(super) fn register_missing(uffd: RawFd, start: u64, len: u64) -> std::io::Result<()> {
    let mut reg = UffdioRegister {
        start,
        len,
        mode: 1,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_REGISTER with a valid struct; the kernel writes the allowed ioctls into `reg`.
    unsafe { uffdio_register(uffd, &mut reg) }?;
    Ok(())
}
