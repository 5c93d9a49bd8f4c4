//! What the simulated device memory holds: a pure function of the per-worker step counters. Kept apart
//! from the code that writes it (the workers in `sim`) because `VERIFY` recomputes it from the counters
//! alone, so a restored copy proves that its device memory came back word for word.

/// Words per block: one kernel writes one block.
pub const BLOCK_WORDS: usize = 512;

/// SplitMix64: the value a kernel writes is a pure function of (device, block word, worker, step).
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Word `i` of device `dev` before any kernel ran.
pub fn initial_word(dev: usize, i: usize) -> u64 {
    mix(((dev as u64) << 56) ^ (i as u64) ^ 0x5151_0000_0000)
}

/// Word `i` of device `dev` as worker `worker` writes it at step `step`.
pub fn kernel_word(dev: usize, i: usize, worker: usize, step: u64) -> u64 {
    mix(((dev as u64) << 56)
        ^ ((worker as u64) << 48)
        ^ step.wrapping_mul(0x1000_0000_01b3)
        ^ ((i as u64) << 1))
}

/// The geometry shared by the kernels and the verifier: worker `w` at step `s` writes block
/// `(s % per_worker) * workers + w`, so no two workers ever write the same block.
#[derive(Clone, Copy)]
pub struct Geometry {
    workers: usize,
    per_worker: usize,
}

impl Geometry {
    pub fn new(bytes: usize, workers: usize) -> Self {
        let words = bytes / 8;
        let blocks = words / BLOCK_WORDS;
        Geometry {
            workers,
            per_worker: (blocks / workers).max(1),
        }
    }

    /// The block worker `worker` writes at step `step`.
    pub fn block_of(&self, worker: usize, step: u64) -> usize {
        (step as usize % self.per_worker) * self.workers + worker
    }

    /// What word `i` of device `dev` must hold after the workers made `steps` steps.
    pub fn expected(&self, dev: usize, i: usize, steps: &[u64]) -> u64 {
        let block = i / BLOCK_WORDS;
        let (worker, k) = (block % self.workers, block / self.workers);
        if k >= self.per_worker || worker >= steps.len() {
            return initial_word(dev, i);
        }
        let s = steps[worker];
        if s <= k as u64 {
            return initial_word(dev, i);
        }
        let p = self.per_worker as u64;
        let last = k as u64 + p * ((s - 1 - k as u64) / p);
        kernel_word(dev, i, worker, last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_content_follows_the_kernels() {
        let geo = Geometry::new(64 * 1024, 3);
        let mut mem: Vec<u64> = (0..64 * 1024 / 8).map(|i| initial_word(1, i)).collect();
        let mut steps = vec![0u64; 3];
        for round in 0..100u64 {
            for (w, step) in steps.iter_mut().enumerate() {
                if (round + w as u64).is_multiple_of(4) {
                    continue; // workers advance unevenly
                }
                let b = geo.block_of(w, *step);
                let block = mem.iter_mut().enumerate().skip(b * BLOCK_WORDS);
                for (i, word) in block.take(BLOCK_WORDS) {
                    *word = kernel_word(1, i, w, *step);
                }
                *step += 1;
            }
        }
        for (i, v) in mem.iter().enumerate() {
            assert_eq!(*v, geo.expected(1, i, &steps), "word {i}");
        }
        mem[7] ^= 1;
        assert_ne!(mem[7], geo.expected(1, 7, &steps));
    }

    #[test]
    fn workers_never_share_a_block() {
        // The workers write their blocks through disjoint slices of one mapping: this must hold.
        let geo = Geometry::new(1 << 20, 5);
        let mut owner = std::collections::HashMap::new();
        for w in 0..5 {
            for step in 0..1000 {
                assert_eq!(*owner.entry(geo.block_of(w, step)).or_insert(w), w);
            }
        }
    }
}
