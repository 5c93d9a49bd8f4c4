//! Deterministic pseudo-random data for tests, benchmarks and the workloads: one xorshift64 generator
//! instead of a hand-written copy in every test file.
//!
//! Why xorshift64: it is a few instructions per 8 bytes (a GiB of workload memory fills in about a second),
//! its output does not compress (the store's "random data stays raw" paths need exactly that), and a seed
//! reproduces the same bytes on every run, so a failing test can be rerun as it was. It is NOT
//! cryptographic and must never be used where unpredictability matters.

/// The xorshift64 generator (Marsaglia's 13/7/17 triple). Also an endless [`Iterator`] over its outputs.
#[derive(Clone, Debug)]
pub struct XorShift64(u64);

impl XorShift64 {
    /// Starts from `state` exactly as given. It must not be 0: xorshift maps 0 to 0 for ever. Small
    /// states give mostly zero bytes at first; [`XorShift64::from_seed`] avoids that.
    pub const fn new(state: u64) -> Self {
        XorShift64(state)
    }

    /// Starts from `seed` spread over all 64 bits (and made odd, so never 0): every seed, 0 included,
    /// gives random-looking output from the first byte on.
    pub const fn from_seed(seed: u64) -> Self {
        XorShift64(seed.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 bits.
    // Inlined across crates: the workloads call this once per word of gigabyte-sized buffers.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Fills `buf` with the next outputs, little-endian, 8 bytes per output; a last partial word uses
    /// its low bytes.
    pub fn fill_bytes(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            c.copy_from_slice(&self.next_u64().to_le_bytes()[..c.len()]);
        }
    }

    /// The next `n` bytes, as [`XorShift64::fill_bytes`] writes them.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut out = vec![0; n];
        self.fill_bytes(&mut out);
        out
    }
}

impl Iterator for XorShift64 {
    type Item = u64;

    #[inline]
    fn next(&mut self) -> Option<u64> {
        Some(self.next_u64())
    }
}

/// `n` incompressible bytes, the same for the same `seed` on every run.
pub fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    XorShift64::from_seed(seed).bytes(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_are_the_xorshift64_sequence() {
        let mut g = XorShift64::new(1);
        assert_eq!(g.next_u64(), 0x4082_2041);
        assert_eq!(g.next_u64(), 0x1000_4106_0c01_1441);
        assert_eq!(g.next(), Some(0x9b1e_842f_6e86_2629));
    }

    #[test]
    fn random_bytes_keep_the_bytes_the_store_tests_were_written_against() {
        // Pinned: tests choose seeds whose data behaves a certain way (random enough, or not).
        assert_eq!(
            random_bytes(12, 0),
            [0xad, 0x4d, 0xf3, 0x0b, 0xae, 0x77, 0x1b, 0xdc, 0x76, 0x60, 0x6e, 0x02]
        );
        assert_eq!(
            random_bytes(8, 41),
            [0x05, 0x97, 0x8e, 0x94, 0x68, 0x79, 0x43, 0xd3]
        );
        assert!(random_bytes(0, 3).is_empty());
    }

    #[test]
    fn partial_words_are_prefixes_of_whole_ones() {
        let whole = random_bytes(64, 7);
        for n in [1, 7, 9, 63] {
            assert_eq!(random_bytes(n, 7), whole[..n]);
        }
        let mut g = XorShift64::from_seed(7);
        let words: Vec<u8> = g.by_ref().take(8).flat_map(u64::to_le_bytes).collect();
        assert_eq!(words, whole);
    }
}
