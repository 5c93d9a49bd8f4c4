//! The checkpoint API's argument structs as `cuda.h` lays them out in each CUDA release, checked when the
//! crate compiles, and which layout a driver version expects ([`ApiLayout`]).

use std::ffi::c_void;

/// `CUcheckpointLockArgs` (all versions): the timeout comes first, as in cuda.h. (One public binding
/// put it last; the header is the authority.)
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct LockArgs {
    pub timeout_ms: u32,
    pub reserved0: u32,
    pub reserved1: [u64; 7],
}

/// `CUcheckpointUnlockArgs` (all versions).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct UnlockArgs {
    pub reserved: [u64; 8],
}

/// `CUcheckpointCheckpointArgs` up to 13.3, and `CUcheckpointRestoreArgs` of 12.8/12.9: all reserved.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ReservedArgs {
    pub reserved: [u64; 8],
}

/// `CUcheckpointCheckpointArgs` of 13.4: custom storage output first. We never ask for custom storage,
/// so the pointer stays null.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CheckpointArgsV13_4 {
    pub custom_storage_info_out: *mut *mut c_void,
    pub reserved: [u64; 7],
}

/// `CUcheckpointGpuPair`: two `CUuuid`s.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GpuPairRaw {
    pub old_uuid: [u8; 16],
    pub new_uuid: [u8; 16],
}

/// `CUcheckpointRestoreArgs` of 13.0-13.2: `char reserved[52 - sizeof(void*)]; cuuint64_t reserved1;`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RestoreArgsV13_0 {
    pub gpu_pairs: *mut GpuPairRaw,
    pub gpu_pairs_count: u32,
    pub reserved: [u8; 52 - std::mem::size_of::<*mut GpuPairRaw>()],
    pub reserved1: u64,
}

/// `CUcheckpointRestoreArgs` of 13.3: `char reserved[64 - sizeof(void*) - sizeof(unsigned)]`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RestoreArgsV13_3 {
    pub gpu_pairs: *mut GpuPairRaw,
    pub gpu_pairs_count: u32,
    pub reserved: [u8; 64 - std::mem::size_of::<*mut GpuPairRaw>() - 4],
}

/// `CUcheckpointRestoreArgs` of 13.4: adds padding and the custom-storage output pointer (null here).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RestoreArgsV13_4 {
    pub gpu_pairs: *mut GpuPairRaw,
    pub gpu_pairs_count: u32,
    pub padding0: u32,
    pub custom_storage_info_out: *mut *mut c_void,
    pub reserved: [u8; 40],
}

// The layouts the driver reads, checked when the crate compiles (a wrong one would pass garbage to the
// driver without any error here): every argument struct is 64 bytes, fields at the offsets of cuda.h.
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<LockArgs>() == 64);
    assert!(size_of::<UnlockArgs>() == 64);
    assert!(size_of::<ReservedArgs>() == 64);
    assert!(size_of::<CheckpointArgsV13_4>() == 64);
    assert!(size_of::<RestoreArgsV13_0>() == 64);
    assert!(size_of::<RestoreArgsV13_3>() == 64);
    assert!(size_of::<RestoreArgsV13_4>() == 64);
    assert!(size_of::<GpuPairRaw>() == 32);
    // Lock: timeoutMs first, then reserved0, then seven 64-bit words.
    assert!(offset_of!(LockArgs, timeout_ms) == 0);
    assert!(offset_of!(LockArgs, reserved0) == 4);
    assert!(offset_of!(LockArgs, reserved1) == 8);
    // 13.4 checkpoint: custom storage pointer first.
    assert!(offset_of!(CheckpointArgsV13_4, custom_storage_info_out) == 0);
    assert!(offset_of!(CheckpointArgsV13_4, reserved) == 8);
    // 13.0 restore: pairs, count, 44 reserved chars, a trailing reserved u64 at 56.
    assert!(offset_of!(RestoreArgsV13_0, gpu_pairs) == 0);
    assert!(offset_of!(RestoreArgsV13_0, gpu_pairs_count) == 8);
    assert!(offset_of!(RestoreArgsV13_0, reserved) == 12);
    assert!(offset_of!(RestoreArgsV13_0, reserved1) == 56);
    // 13.3 restore: pairs, count, 52 reserved chars.
    assert!(offset_of!(RestoreArgsV13_3, gpu_pairs_count) == 8);
    assert!(offset_of!(RestoreArgsV13_3, reserved) == 12);
    // 13.4 restore: pairs, count, padding, custom storage pointer at 16.
    assert!(offset_of!(RestoreArgsV13_4, gpu_pairs_count) == 8);
    assert!(offset_of!(RestoreArgsV13_4, padding0) == 12);
    assert!(offset_of!(RestoreArgsV13_4, custom_storage_info_out) == 16);
    assert!(offset_of!(RestoreArgsV13_4, reserved) == 24);
    assert!(offset_of!(GpuPairRaw, new_uuid) == 16);
};

/// Which argument layouts a driver expects, from `cuDriverGetVersion` (1000 * major + 10 * minor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiLayout {
    /// 12.8 and 12.9 (drivers 570, 575): no GPU remapping.
    V12_8,
    /// 13.0-13.2 (driver 580+): GPU pairs on restore.
    V13_0,
    /// 13.3: the reserved tail of the restore args changed.
    V13_3,
    /// 13.4 and later: custom-storage output pointers.
    V13_4,
}

impl ApiLayout {
    /// `None` before 12.8: those drivers have no checkpoint API.
    pub fn for_version(version: i32) -> Option<Self> {
        Some(match version {
            v if v < 12080 => return None,
            v if v < 13000 => ApiLayout::V12_8,
            v if v < 13030 => ApiLayout::V13_0,
            v if v < 13040 => ApiLayout::V13_3,
            // Later releases: the newest layout we know; reserved bytes are zero either way.
            _ => ApiLayout::V13_4,
        })
    }

    pub fn supports_gpu_pairs(self) -> bool {
        self != ApiLayout::V12_8
    }

    /// The first CUDA release with this layout, as `doctor` and the docs name it.
    pub fn name(self) -> &'static str {
        match self {
            ApiLayout::V12_8 => "12.8",
            ApiLayout::V13_0 => "13.0",
            ApiLayout::V13_3 => "13.3",
            ApiLayout::V13_4 => "13.4",
        }
    }
}

/// "13.0" from 13000.
pub fn version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_follows_the_driver_version() {
        assert_eq!(ApiLayout::for_version(12040), None);
        assert_eq!(ApiLayout::for_version(12080), Some(ApiLayout::V12_8));
        assert_eq!(ApiLayout::for_version(12090), Some(ApiLayout::V12_8));
        assert_eq!(ApiLayout::for_version(13000), Some(ApiLayout::V13_0));
        assert_eq!(ApiLayout::for_version(13020), Some(ApiLayout::V13_0));
        assert_eq!(ApiLayout::for_version(13030), Some(ApiLayout::V13_3));
        assert_eq!(ApiLayout::for_version(13040), Some(ApiLayout::V13_4));
        assert_eq!(ApiLayout::for_version(14000), Some(ApiLayout::V13_4));
        assert!(!ApiLayout::V12_8.supports_gpu_pairs());
        assert!(ApiLayout::V13_0.supports_gpu_pairs());
        assert_eq!(version_text(13000), "13.0");
        assert_eq!(version_text(12080), "12.8");
    }

    #[test]
    fn the_pair_fields_land_in_the_same_place_in_every_remapping_layout() {
        // What we set (pairs pointer, count) sits at offsets 0 and 8 in 13.0, 13.3 and 13.4; everything
        // else is zero. A wrong layout choice between these can therefore not corrupt the call.
        let mut pair = GpuPairRaw::default();
        let a = RestoreArgsV13_0 {
            gpu_pairs: &mut pair,
            gpu_pairs_count: 1,
            reserved: [0; 44],
            reserved1: 0,
        };
        let b = RestoreArgsV13_4 {
            gpu_pairs: &mut pair,
            gpu_pairs_count: 1,
            padding0: 0,
            custom_storage_info_out: std::ptr::null_mut(),
            reserved: [0; 40],
        };
        // SAFETY: both are 64-byte plain structs.
        let (ba, bb): ([u8; 64], [u8; 64]) =
            unsafe { (std::mem::transmute_copy(&a), std::mem::transmute_copy(&b)) };
        assert_eq!(ba, bb);
        assert!(ba[16..].iter().all(|&x| x == 0));
    }
}
