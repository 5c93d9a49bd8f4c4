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

/// `struct uffdio_range`.
#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
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
/// The events CRIU asks for on every userfaultfd it opens (criu/uffd.c, `NEED_UFFD_API_FEATURES`): they
/// come only while a process runs with its registration, i.e. during a restore that resumes the
/// processes before all of their memory is in.
const UFFD_EVENT_FORK: u8 = 0x13;
const UFFD_EVENT_REMAP: u8 = 0x14;
const UFFD_EVENT_REMOVE: u8 = 0x15;
const UFFD_EVENT_UNMAP: u8 = 0x16;

/// One message read from a userfaultfd, decoded.
#[derive(Debug)]
pub(super) enum Event {
    /// A thread touched the missing page at this address and waits for it.
    Fault(u64),
    /// The process forked: the child's userfaultfd (installed in this process by the read), registered
    /// where the parent's memory was.
    Fork(OwnedFd),
    /// `mremap` moved `[from, from + len)` to `to`.
    Remap { from: u64, to: u64, len: u64 },
    /// `MADV_DONTNEED`/`MADV_REMOVE` dropped `[start, end)`: it reads as zeros from now on.
    Remove { start: u64, end: u64 },
    /// `munmap` (or a mapping over it) removed `[start, end)`.
    Unmap { start: u64, end: u64 },
    /// An event this restore did not ask for.
    Other(u8),
}

impl UffdMsg {
    /// The event, with its arguments (linux/userfaultfd.h, `struct uffd_msg`'s union).
    pub(super) fn decode(self) -> Event {
        let [a, b, c] = self.arg;
        match self.event {
            UFFD_EVENT_PAGEFAULT => Event::Fault(b),
            UFFD_EVENT_FORK => {
                // SAFETY: the kernel installed this descriptor in our table for the read that returned
                // the message; nothing else owns it.
                Event::Fork(unsafe { OwnedFd::from_raw_fd(a as u32 as RawFd) })
            }
            UFFD_EVENT_REMAP => Event::Remap {
                from: a,
                to: b,
                len: c,
            },
            UFFD_EVENT_REMOVE => Event::Remove { start: a, end: b },
            UFFD_EVENT_UNMAP => Event::Unmap { start: a, end: b },
            e => Event::Other(e),
        }
    }
}

// The layouts of linux/userfaultfd.h: a struct of another size would be a different request code, or have
// the kernel read and write past ours.
const _: () = assert!(size_of::<UffdioApi>() == 24);
const _: () = assert!(size_of::<UffdioCopy>() == 40);
const _: () = assert!(size_of::<UffdioZeropage>() == 32);
const _: () = assert!(size_of::<UffdioRange>() == 16);
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
const _: () =
    assert!(nix::request_code_read!(UFFDIO, 0x02, size_of::<UffdioRange>()) == 0x8010_AA02);
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
nix::ioctl_read!(
    /// `UFFDIO_WAKE`.
    uffdio_wake,
    UFFDIO,
    0x02,
    UffdioRange
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

/// How far a [`copy`] got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Copied {
    /// Every page is there (copied now, or there already).
    All,
    /// The process's mappings are changing (a fork, `mremap`, `munmap` or `MADV_DONTNEED` waits for its
    /// event to be read): this many bytes were copied; the rest must be looked at again once the event
    /// has been read.
    Again(u64),
    /// The process's memory is gone (it exited or called `exec`): nothing more can be copied into it.
    Gone,
}

/// `UFFDIO_COPY` of `src` to `dst` (page-aligned, whole pages), resumed after partial copies. A page that
/// is there already (served by a fault, or copied by another path) is skipped.
pub(super) fn copy(uffd: RawFd, dst: u64, src: &[u8]) -> std::io::Result<Copied> {
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
            // Partly done (the part is counted above): the next call meets what stopped it.
            Err(Errno::EAGAIN) if c.copy > 0 => {}
            Err(Errno::EAGAIN) => return Ok(Copied::Again(done)),
            Err(Errno::EEXIST) => done += page_size(),
            Err(Errno::ESRCH) => return Ok(Copied::Gone),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Copied::All)
}

/// Wakes the threads waiting on a fault in `[start, start + len)` (for a fault whose page another path
/// placed, or one answered with nothing to copy).
pub(super) fn wake(uffd: RawFd, start: u64, len: u64) -> std::io::Result<()> {
    let mut r = UffdioRange { start, len };
    // SAFETY: UFFDIO_WAKE reads a valid range struct.
    unsafe { uffdio_wake(uffd, &mut r) }?;
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
