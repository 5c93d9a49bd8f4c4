//! Progress bars for the store's long phases (ingest, restore, verify), and byte formatting for reports.

use std::io::IsTerminal;

use gpu_checkpoint::store::Progress;
use indicatif::{ProgressBar, ProgressStyle};

/// A [`Progress`] drawn on stderr: bytes, rate and ETA per phase. Hidden when stderr is not a terminal or
/// when the output is machine-readable (`--format json`), so stdout and logs stay clean.
pub struct Bar {
    bar: ProgressBar,
}

impl Bar {
    /// `visible`: the caller's wish (false with `--format json`); the bar is also hidden off a terminal.
    pub fn new(visible: bool) -> Bar {
        let bar = if visible && std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(0);
            bar.set_style(
                ProgressStyle::with_template(
                    "{msg:>16} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            bar
        } else {
            ProgressBar::hidden()
        };
        Bar { bar }
    }
}

impl Progress for Bar {
    fn start(&self, phase: &str, total_bytes: u64) {
        // Length and name first: a redraw in between would show a full bar of "0 B/0 B" for a moment.
        self.bar.set_message(phase.to_owned());
        self.bar.set_length(total_bytes);
        self.bar.set_position(0);
        self.bar.reset_elapsed();
        self.bar.reset_eta();
    }

    fn advance(&self, bytes: u64) {
        self.bar.inc(bytes);
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// `1.5 GiB`, `17 B`: the library's formatter, so that sizes in the store's summaries read as they do in
/// `detect`'s evidence.
pub use gpu_checkpoint::fmt::human_bytes as bytes;

/// `850 ms`, `12.3 s`.
pub fn millis(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms} ms")
    } else {
        format!("{:.1} s", ms as f64 / 1000.0)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn formats() {
        assert_eq!(super::bytes(17), "17 B");
        assert_eq!(super::bytes(1536), "1.5 KiB");
        assert_eq!(super::bytes(5 << 30), "5.0 GiB");
        assert_eq!(super::millis(850), "850 ms");
        assert_eq!(super::millis(12_345), "12.3 s");
    }
}
