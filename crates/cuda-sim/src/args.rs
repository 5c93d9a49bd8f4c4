//! The checkpoint API's argument structs as the real driver reads them: 64 raw bytes, fields at the
//! offsets of `cuda.h` for the driver version being simulated, every reserved byte zero.
//!
//! Read from raw bytes on purpose, not through the backend's own structs (`freeze::cuda_driver`): a wrong
//! layout on the caller's side must show up here as `CUDA_ERROR_INVALID_VALUE`, as it would on a real
//! driver, instead of being read back the same wrong way.

/// Every argument struct is 64 bytes.
pub const ARGS_SIZE: usize = 64;

/// The layouts, by the CUDA version the simulated driver reports (`cuDriverGetVersion`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// 12.8, 12.9: restore args all reserved.
    V12_8,
    /// 13.0-13.2: `{ gpuPairs; gpuPairsCount; char reserved[52 - sizeof(void*)]; cuuint64_t reserved1; }`.
    V13_0,
    /// 13.3: `{ gpuPairs; gpuPairsCount; char reserved[64 - sizeof(void*) - sizeof(unsigned)]; }`.
    V13_3,
    /// 13.4: custom-storage output pointers in the checkpoint and restore args.
    V13_4,
}

impl Layout {
    pub fn of(version: i32) -> Option<Layout> {
        Some(match version {
            v if v < 12080 => return None,
            v if v < 13000 => Layout::V12_8,
            v if v < 13030 => Layout::V13_0,
            v if v < 13040 => Layout::V13_3,
            _ => Layout::V13_4,
        })
    }
}

/// What a caller asked for, once its bytes passed the checks.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    Lock { timeout_ms: u32 },
    Plain,
    Restore { pairs: usize, count: u32 },
}

/// Why the bytes were refused: the field, for the simulator's message.
pub type Refused = String;

fn zero(b: &[u8], from: usize, to: usize, what: &str) -> Result<(), Refused> {
    match b[from..to].iter().position(|&x| x != 0) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: reserved byte {} is {:#04x}, must be 0",
            from + i,
            b[from + i]
        )),
    }
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_ne_bytes(b[off..off + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_ne_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}

/// `CUcheckpointLockArgs { unsigned timeoutMs; unsigned reserved0; cuuint64_t reserved1[7]; }`.
pub fn lock(b: &[u8; ARGS_SIZE]) -> Result<Parsed, Refused> {
    zero(b, 4, ARGS_SIZE, "CUcheckpointLockArgs")?;
    Ok(Parsed::Lock {
        timeout_ms: u32_at(b, 0),
    })
}

/// `CUcheckpointUnlockArgs { cuuint64_t reserved[8]; }`.
pub fn unlock(b: &[u8; ARGS_SIZE]) -> Result<Parsed, Refused> {
    zero(b, 0, ARGS_SIZE, "CUcheckpointUnlockArgs")?;
    Ok(Parsed::Plain)
}

/// `CUcheckpointCheckpointArgs`: reserved up to 13.3; 13.4 puts `customStorageInfo_out` first, which
/// the simulator does not model: it must be null.
pub fn checkpoint(layout: Layout, b: &[u8; ARGS_SIZE]) -> Result<Parsed, Refused> {
    let what = "CUcheckpointCheckpointArgs";
    if layout == Layout::V13_4 && u64_at(b, 0) != 0 {
        return Err(format!(
            "{what}: customStorageInfo_out is not simulated (SIMULATED driver); pass null"
        ));
    }
    zero(b, 0, ARGS_SIZE, what)?;
    Ok(Parsed::Plain)
}

/// `CUcheckpointRestoreArgs` of the layout: the GPU pair list (pointer and count) where the layout has
/// one, every other byte zero.
pub fn restore(layout: Layout, b: &[u8; ARGS_SIZE]) -> Result<Parsed, Refused> {
    let what = "CUcheckpointRestoreArgs";
    let reserved_from = match layout {
        Layout::V12_8 => {
            zero(b, 0, ARGS_SIZE, what)?;
            return Ok(Parsed::Restore { pairs: 0, count: 0 });
        }
        // char reserved[44] at 12, then cuuint64_t reserved1 at 56: zero alike.
        Layout::V13_0 | Layout::V13_3 => 12,
        Layout::V13_4 => {
            zero(b, 12, 16, "CUcheckpointRestoreArgs.padding0")?;
            if u64_at(b, 16) != 0 {
                return Err(format!(
                    "{what}: customStorageInfo_out is not simulated (SIMULATED driver); pass null"
                ));
            }
            24
        }
    };
    zero(b, reserved_from, ARGS_SIZE, what)?;
    let pairs = u64_at(b, 0) as usize;
    let count = u32_at(b, 8);
    if (pairs == 0) != (count == 0) {
        return Err(format!(
            "{what}: gpuPairs and gpuPairsCount disagree (pointer {pairs:#x}, count {count})"
        ));
    }
    Ok(Parsed::Restore { pairs, count })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(fields: &[(usize, &[u8])]) -> [u8; ARGS_SIZE] {
        let mut b = [0u8; ARGS_SIZE];
        for (off, v) in fields {
            b[*off..*off + v.len()].copy_from_slice(v);
        }
        b
    }

    #[test]
    fn layouts_follow_the_driver_version() {
        assert_eq!(Layout::of(12070), None);
        assert_eq!(Layout::of(12080), Some(Layout::V12_8));
        assert_eq!(Layout::of(12090), Some(Layout::V12_8));
        assert_eq!(Layout::of(13020), Some(Layout::V13_0));
        assert_eq!(Layout::of(13030), Some(Layout::V13_3));
        assert_eq!(Layout::of(13040), Some(Layout::V13_4));
    }

    #[test]
    fn the_timeout_comes_first_and_the_rest_is_reserved() {
        let b = bytes(&[(0, &250u32.to_ne_bytes())]);
        assert_eq!(lock(&b), Ok(Parsed::Lock { timeout_ms: 250 }));
        // The binding that put timeoutMs last would write it at 60: refused as the driver would.
        let wrong = bytes(&[(60, &250u32.to_ne_bytes())]);
        assert!(lock(&wrong).unwrap_err().contains("reserved byte 60"));
    }

    #[test]
    fn restore_args_are_read_per_layout() {
        let p = 0x1000u64.to_ne_bytes();
        let one = 1u32.to_ne_bytes();
        let b = bytes(&[(0, &p), (8, &one)]);
        for l in [Layout::V13_0, Layout::V13_3, Layout::V13_4] {
            assert_eq!(
                restore(l, &b),
                Ok(Parsed::Restore {
                    pairs: 0x1000,
                    count: 1
                })
            );
        }
        // 12.8 has no pairs: a caller that sends 13.x args to a 12.8 driver is refused.
        assert!(restore(Layout::V12_8, &b).is_err());
        // 13.0's reserved1 at 56 is reserved; 13.4's custom storage pointer at 16 is not simulated.
        let b = bytes(&[(56, &[1])]);
        assert!(restore(Layout::V13_0, &b).is_err());
        let b = bytes(&[(16, &p)]);
        assert!(restore(Layout::V13_4, &b)
            .unwrap_err()
            .contains("customStorage"));
        // A count without a list.
        let b = bytes(&[(8, &one)]);
        assert!(restore(Layout::V13_3, &b).unwrap_err().contains("disagree"));
    }

    #[test]
    fn checkpoint_and_unlock_args_are_all_reserved() {
        assert_eq!(unlock(&[0; ARGS_SIZE]), Ok(Parsed::Plain));
        assert!(unlock(&bytes(&[(63, &[1])])).is_err());
        assert_eq!(
            checkpoint(Layout::V13_3, &[0; ARGS_SIZE]),
            Ok(Parsed::Plain)
        );
        assert!(checkpoint(Layout::V13_4, &bytes(&[(0, &[8])])).is_err());
    }
}
