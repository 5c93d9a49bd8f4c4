//! cuda-counter: a small REAL CUDA program for validating gpu-checkpoint on NVIDIA hardware (no nvcc
//! needed: it loads libcuda at run time and JIT-compiles a PTX kernel).
//!
//! It allocates `--mib` MiB of device memory, zeroes it, and then loops: launch a kernel that adds 1 to
//! every 32-bit word, synchronise, and every `--check-every` iterations copy the whole buffer back and
//! check that every word equals the iteration count, which lives only in host memory. A line
//! `iter=N verified=ok` is printed per check; any difference prints `MISMATCH` and exits 3. So after a
//! checkpoint and restore, further `verified=ok` lines prove that device memory came back intact and
//! that the computation continued where it stopped.
//!
//! Options: `--mib M` (256), `--check-every K` (50), `--sleep-ms S` (10, between iterations),
//! `--pidfile PATH`.

use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::io::Write;
use std::time::{Duration, Instant};

type CuResult = c_int;

/// Increments every u32 of `buf[0..n]` by one.
const PTX: &str = r#"
.version 7.0
.target sm_50
.address_size 64

.visible .entry inc(.param .u64 buf, .param .u32 n)
{
    .reg .pred p;
    .reg .b32 r<7>;
    .reg .b64 rd<5>;
    ld.param.u64 rd1, [buf];
    ld.param.u32 r1, [n];
    mov.u32 r2, %ctaid.x;
    mov.u32 r3, %ntid.x;
    mov.u32 r4, %tid.x;
    mad.lo.s32 r5, r2, r3, r4;
    setp.ge.u32 p, r5, r1;
    @p bra DONE;
    cvta.to.global.u64 rd2, rd1;
    mul.wide.u32 rd3, r5, 4;
    add.s64 rd4, rd2, rd3;
    ld.global.u32 r6, [rd4];
    add.s32 r6, r6, 1;
    st.global.u32 [rd4], r6;
DONE:
    ret;
}
"#;

fn die(msg: &str) -> ! {
    eprintln!("cuda-counter: {msg}");
    std::process::exit(2)
}

struct Cuda {
    lib: *mut c_void,
}

impl Cuda {
    fn open() -> Self {
        // SAFETY: dlopen of the driver library; checked for null.
        let lib = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
        if lib.is_null() {
            die("cannot load libcuda.so.1 (no NVIDIA driver?)");
        }
        Cuda { lib }
    }

    /// # Safety
    /// `T` must be the function's type.
    unsafe fn sym<T: Copy>(&self, name: &str) -> T {
        let c = CString::new(name).unwrap_or_else(|_| die("bad symbol name"));
        let p = libc::dlsym(self.lib, c.as_ptr());
        if p.is_null() {
            die(&format!("libcuda has no {name}"));
        }
        std::mem::transmute_copy(&p)
    }
}

fn check(what: &str, r: CuResult) {
    if r != 0 {
        die(&format!("{what} failed with CUresult {r}"));
    }
}

fn main() {
    let mut mib: usize = 256;
    let mut check_every: u64 = 50;
    let mut sleep_ms: u64 = 10;
    let mut pidfile: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || {
            args.next()
                .unwrap_or_else(|| die(&format!("{a} needs a value")))
        };
        match a.as_str() {
            "--mib" => mib = val().parse().unwrap_or_else(|_| die("--mib: a number")),
            "--check-every" => {
                check_every = val()
                    .parse()
                    .unwrap_or_else(|_| die("--check-every: a number"))
            }
            "--sleep-ms" => {
                sleep_ms = val()
                    .parse()
                    .unwrap_or_else(|_| die("--sleep-ms: a number"))
            }
            "--pidfile" => pidfile = Some(val()),
            other => die(&format!("unknown option {other}")),
        }
    }
    let words = (mib << 20) / 4;
    let cuda = Cuda::open();
    // SAFETY: every type below is the cuda.h declaration of the function named.
    unsafe {
        let init: unsafe extern "C" fn(c_uint) -> CuResult = cuda.sym("cuInit");
        let device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult =
            cuda.sym("cuDeviceGet");
        let retain: unsafe extern "C" fn(*mut *mut c_void, c_int) -> CuResult =
            cuda.sym("cuDevicePrimaryCtxRetain");
        let set_current: unsafe extern "C" fn(*mut c_void) -> CuResult =
            cuda.sym("cuCtxSetCurrent");
        let mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> CuResult =
            cuda.sym("cuMemAlloc_v2");
        let memset: unsafe extern "C" fn(u64, c_uint, usize) -> CuResult =
            cuda.sym("cuMemsetD32_v2");
        let dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> CuResult =
            cuda.sym("cuMemcpyDtoH_v2");
        let load: unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> CuResult =
            cuda.sym("cuModuleLoadData");
        let get_fn: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> CuResult =
            cuda.sym("cuModuleGetFunction");
        #[allow(clippy::type_complexity)]
        let launch: unsafe extern "C" fn(
            *mut c_void,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            *mut c_void,
            *mut *mut c_void,
            *mut *mut c_void,
        ) -> CuResult = cuda.sym("cuLaunchKernel");
        let sync: unsafe extern "C" fn() -> CuResult = cuda.sym("cuCtxSynchronize");

        check("cuInit", init(0));
        let mut dev = 0;
        check("cuDeviceGet", device_get(&mut dev, 0));
        let mut ctx = std::ptr::null_mut();
        check("cuDevicePrimaryCtxRetain", retain(&mut ctx, dev));
        check("cuCtxSetCurrent", set_current(ctx));
        let mut buf = 0u64;
        check("cuMemAlloc", mem_alloc(&mut buf, words * 4));
        check("cuMemsetD32", memset(buf, 0, words));
        let ptx = CString::new(PTX).unwrap_or_else(|_| die("ptx"));
        let mut module = std::ptr::null_mut();
        check("cuModuleLoadData", load(&mut module, ptx.as_ptr().cast()));
        let mut func = std::ptr::null_mut();
        check(
            "cuModuleGetFunction",
            get_fn(&mut func, module, c"inc".as_ptr()),
        );

        if let Some(p) = &pidfile {
            let _ = std::fs::write(p, format!("{}\n", std::process::id()));
        }
        println!(
            "cuda-counter: pid {} holds {mib} MiB of device memory; checking every {check_every} iterations",
            std::process::id()
        );
        let mut host = vec![0u32; words];
        let n = words as c_uint;
        let threads = 256u32;
        let blocks = (n).div_ceil(threads);
        let mut iter: u64 = 0;
        let started = Instant::now();
        loop {
            let mut p_buf = buf;
            let mut p_n = n;
            let mut params = [
                (&mut p_buf as *mut u64).cast::<c_void>(),
                (&mut p_n as *mut c_uint).cast::<c_void>(),
            ];
            check(
                "cuLaunchKernel",
                launch(
                    func,
                    blocks,
                    1,
                    1,
                    threads,
                    1,
                    1,
                    0,
                    std::ptr::null_mut(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
            );
            check("cuCtxSynchronize", sync());
            iter += 1;
            if iter.is_multiple_of(check_every.max(1)) {
                check(
                    "cuMemcpyDtoH",
                    dtoh(host.as_mut_ptr().cast(), buf, words * 4),
                );
                let expected = iter as u32;
                if let Some(i) = host.iter().position(|&w| w != expected) {
                    println!(
                        "iter={iter} MISMATCH at word {i}: {} != {expected}",
                        host[i]
                    );
                    let _ = std::io::stdout().flush();
                    std::process::exit(3);
                }
                println!(
                    "iter={iter} verified=ok words={words} elapsed_s={:.1}",
                    started.elapsed().as_secs_f64()
                );
                let _ = std::io::stdout().flush();
            }
            std::thread::sleep(Duration::from_millis(sleep_ms));
        }
    }
}
