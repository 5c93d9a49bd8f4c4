//! A stand-in for CRIU in unit tests of the flows: it writes small fake images and logs, can be told to
//! fail, and records what it was asked. It never pretends to restore a real process: `restore` returns
//! the PID the test configured.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Mutex;

use super::log::failure;
use super::streamer;
use super::{
    AfterDump, CheckOutcome, Criu, CriuOptions, CriuVersion, DumpRequest, Error, Op, RestoreRequest,
};

/// One call the fake received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FakeCriuCall {
    Dump {
        pid: i32,
        images_dir: PathBuf,
        after: AfterDump,
        /// The CRIU options the dump was asked for.
        options: CriuOptions,
        /// Whether the images went through the image streamer.
        stream: bool,
    },
    Restore {
        images_dir: PathBuf,
        /// The CRIU options the restore was asked for.
        options: CriuOptions,
        /// With `stream`: the page image the fake received from the image streamer.
        pages: Option<Vec<u8>>,
    },
}

/// The fake CRIU (tests only; chosen explicitly, never discovered).
#[derive(Debug, Default)]
pub struct FakeCriu {
    state: Mutex<FakeState>,
}

#[derive(Debug, Default)]
struct FakeState {
    calls: Vec<FakeCriuCall>,
    dump_error: Option<String>,
    restore_error: Option<String>,
    restore_pid: i32,
    image_bytes: usize,
    odd_file: bool,
    lazy_memory: bool,
    skip_notifications: bool,
    /// The nftables table dumps log locking a connection in (`--tcp-established`).
    nft_lock: Option<String>,
}

impl FakeCriu {
    pub fn new() -> Self {
        let fake = FakeCriu::default();
        fake.lock().image_bytes = 4096;
        fake
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FakeState> {
        // A test that panicked while holding the lock has failed already; keep the data usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes every dump fail, logging `Error (fake.c:1): <line>`.
    pub fn fail_dumps(&self, line: &str) -> &Self {
        self.lock().dump_error = Some(line.to_string());
        self
    }

    /// Makes every restore fail, logging `Error (fake.c:1): <line>`.
    pub fn fail_restores(&self, line: &str) -> &Self {
        self.lock().restore_error = Some(line.to_string());
        self
    }

    /// The PID `restore` answers.
    pub fn restore_as(&self, pid: i32) -> &Self {
        self.lock().restore_pid = pid;
        self
    }

    /// Size of the fake page image a dump writes.
    pub fn image_bytes(&self, n: usize) -> &Self {
        self.lock().image_bytes = n;
        self
    }

    /// Makes dumps also leave a symlink among the images, which the store refuses to ingest: a way to
    /// make the store write fail after a successful dump.
    pub fn leave_odd_file(&self) -> &Self {
        self.lock().odd_file = true;
        self
    }

    /// Makes dumps also write the pagemap and mm images of a process whose page image (but its first
    /// page, a stack) CRIU may leave to userfaultfd, as real dumps do for heap memory.
    pub fn lazy_memory(&self) -> &Self {
        self.lock().lazy_memory = true;
        self
    }

    /// Makes restores skip the post-restore hook (a CRIU that never notifies).
    pub fn skip_notifications(&self) -> &Self {
        self.lock().skip_notifications = true;
        self
    }

    /// Makes dumps log the lock of one connection in nftables table `table`, as CRIU's dump with
    /// `--tcp-established` does.
    pub fn lock_connection_in(&self, table: &str) -> &Self {
        self.lock().nft_lock = Some(table.to_string());
        self
    }

    pub fn calls(&self) -> Vec<FakeCriuCall> {
        self.lock().calls.clone()
    }
}

fn write(path: PathBuf, data: &[u8]) -> Result<(), Error> {
    std::fs::write(&path, data).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

/// Writes an injected failure into the operation's log the way CRIU would, and returns the failure as
/// the real client reports it (read back from that log).
fn fail_logged(op: Op, log: PathBuf, line: &str) -> Result<Error, Error> {
    write(
        log.clone(),
        format!("(00.1) Error (fake.c:1): {line}\n").as_bytes(),
    )?;
    Ok(Error::Failed(failure(op, None, None, Some(&log))))
}

impl Criu for FakeCriu {
    fn describe(&self) -> String {
        "fake CRIU (tests)".into()
    }

    fn version(&self) -> Result<CriuVersion, Error> {
        Ok(CriuVersion {
            major: 4,
            minor: 1,
            sublevel: 1,
        })
    }

    fn check_permitted(&self) -> Result<(), Error> {
        Ok(())
    }

    fn check(&self) -> Result<CheckOutcome, Error> {
        Ok(CheckOutcome {
            ok: true,
            output: "Looks good (fake CRIU).\n".into(),
        })
    }

    fn dump(&self, req: &DumpRequest<'_>) -> Result<(), Error> {
        let (error, size, odd) = {
            let mut s = self.lock();
            s.calls.push(FakeCriuCall::Dump {
                pid: req.pid,
                images_dir: req.images_dir.to_path_buf(),
                after: req.after,
                options: req.options.clone(),
                stream: req.stream,
            });
            (s.dump_error.clone(), s.image_bytes, s.odd_file)
        };
        let log = req.images_dir.join(req.log_file);
        // Without streaming the injected failure comes first (nothing written); with it, after the images
        // went out, as when CRIU fails late in a dump: the store then holds chunks no checkpoint names.
        if let (Some(line), false) = (&error, req.stream) {
            return Err(fail_logged(Op::Dump, log, line)?);
        }
        // Like CRIU, the tree is stopped while its images are written; a leave-stopped dump keeps it so
        // (the caller must continue or kill it), a failed one resumes it.
        let signal = |sig| {
            if req.after == AfterDump::Stop {
                // SAFETY: kill has no memory-safety preconditions.
                unsafe { libc::kill(req.pid, sig) };
            }
        };
        signal(libc::SIGSTOP);
        let written = self.write_images(req, error, size, odd, log);
        if written.is_err() {
            signal(libc::SIGCONT);
        }
        written
    }

    fn restore(&self, req: &RestoreRequest<'_>) -> Result<i32, Error> {
        self.restore_tree(req)
    }
}

impl FakeCriu {
    /// The images of a dump, into the streamer or the staging folder, then the log.
    fn write_images(
        &self,
        req: &DumpRequest<'_>,
        error: Option<String>,
        size: usize,
        odd: bool,
        log: std::path::PathBuf,
    ) -> Result<(), Error> {
        let mut images = vec![
            (
                format!("core-{}.img", req.pid),
                req.pid.to_le_bytes().to_vec(),
            ),
            ("pages-1.img".to_string(), vec![0xa5; size]),
        ];
        if self.lock().lazy_memory {
            use super::images::{encode, image, PE_LAZY, PE_PRESENT};
            let (base, pages) = (0x7f00_0000_0000u64, (size as u64).div_ceil(4096));
            images.push((
                format!("pagemap-{}.img", req.pid),
                image(&[
                    encode::pagemap_head(1),
                    encode::pagemap_entry(base, 1, PE_PRESENT),
                    encode::pagemap_entry(base + 4096, pages - 1, PE_PRESENT | PE_LAZY),
                ]),
            ));
            images.push((
                format!("mm-{}.img", req.pid),
                image(&[encode::mm(&[(base, base + pages * 4096)])]),
            ));
        }
        if req.stream {
            // Like `criu dump --stream`: every image goes through a pipe to the streamer; a broken pipe
            // (the streamer gave up) fails the dump.
            let streamed = (|| -> std::io::Result<()> {
                let mut sock = streamer::client::connect(req.images_dir, streamer::Mode::Capture)?;
                for (name, data) in &images {
                    let mut pipe =
                        streamer::client::open(&mut sock, streamer::Mode::Capture, name)?
                            .expect("capture always takes the image");
                    pipe.write_all(data)?;
                }
                Ok(())
            })();
            if let Err(e) = streamed {
                return Err(fail_logged(
                    Op::Dump,
                    log,
                    &format!("Unable to write to the image streamer: {e}"),
                )?);
            }
        } else {
            for (name, data) in &images {
                write(req.images_dir.join(name), data)?;
            }
        }
        if let Some(line) = error {
            return Err(fail_logged(Op::Dump, log, &line)?);
        }
        let mut text = String::new();
        if let Some(table) = &self.lock().nft_lock {
            text += &format!("(00.1) Running nftables [add element inet {table} conns4 {{ 127.0.0.1 . 1 . 127.0.0.1 . 2 }}]\n");
        }
        text += "(00.1) Dumping finished successfully (fake)\n";
        write(log, text.as_bytes())?;
        if odd {
            let link = req.images_dir.join("odd.lnk");
            std::os::unix::fs::symlink("pages-1.img", &link)
                .map_err(|e| Error::io(format!("creating {}", link.display()), e))?;
        }
        Ok(())
    }

    fn restore_tree(&self, req: &RestoreRequest<'_>) -> Result<i32, Error> {
        let (error, pid) = {
            let s = self.lock();
            (s.restore_error.clone(), s.restore_pid)
        };
        let log = req.images_dir.join(req.log_file);
        // Like `criu restore --stream`: asks the streamer for the page image and reads it to its end; a pipe
        // closed early (the streamer found a damaged chunk) fails the restore.
        let pages = if req.stream {
            let received = (|| -> std::io::Result<Vec<u8>> {
                let mut sock = streamer::client::connect(req.images_dir, streamer::Mode::Serve)?;
                let mut pipe =
                    streamer::client::open(&mut sock, streamer::Mode::Serve, "pages-1.img")?
                        .ok_or_else(|| std::io::Error::other("pages-1.img: no such image"))?;
                let mut data = Vec::new();
                pipe.read_to_end(&mut data)?;
                Ok(data)
            })();
            match received {
                Ok(d) => Some(d),
                Err(e) => {
                    return Err(fail_logged(
                        Op::Restore,
                        log,
                        &format!("Unable to read from the image streamer: {e}"),
                    )?)
                }
            }
        } else {
            None
        };
        self.lock().calls.push(FakeCriuCall::Restore {
            images_dir: req.images_dir.to_path_buf(),
            options: req.options.clone(),
            pages,
        });
        if let Some(line) = error {
            return Err(fail_logged(Op::Restore, log, &line)?);
        }
        // As CRIU does with `notify_scripts`: the hook runs with the tree restored, and its failure
        // aborts the restore.
        let notify = !self.lock().skip_notifications;
        if let (Some(hook), true) = (req.post_restore, notify) {
            if let Err(e) = hook() {
                return Err(fail_logged(
                    Op::Restore,
                    log,
                    &format!("Aborting restore due to post-restore script ret code 1 ({e})"),
                )?);
            }
        }
        write(log, b"(00.1) Restore finished successfully (fake)\n")?;
        Ok(pid)
    }
}
