//! The CRIU images a userfaultfd restore reads itself: `pagemap-PID.img` (which pages of a process its
//! page image holds, in order, and which of them CRIU may leave to userfaultfd), `mm-PID.img` (the
//! process's mappings, whose bounds one `UFFDIO_COPY` must not cross, and which of them a child shares
//! with its parent) and `pstree.img` (who is whose parent); and the one image it writes back: a pagemap
//! whose entries say differently which pages CRIU leaves to userfaultfd ([`write_pagemap`]).
//!
//! A CRIU image is two magic words (the common image magic, then the image type's), then entries: a
//! 32-bit little-endian length and a protobuf message of that length (`images/pagemap.proto`,
//! `images/mm.proto`, `images/vma.proto` in CRIU's sources). Only the fields used here are decoded; the
//! rest are skipped, so images with fields added by later CRIUs still read.

use protobuf::rt::WireType;
use protobuf::CodedInputStream;

/// `IMG_COMMON_MAGIC` (criu/include/magic.h).
const IMG_COMMON_MAGIC: u32 = 0x5456_4319;

/// Pagemap entry flags (criu/include/pagemap.h).
/// The pages are in a parent checkpoint's images (incremental dumps; none here).
pub const PE_PARENT: u32 = 1 << 0;
/// CRIU may leave the pages to a userfaultfd handler (`--lazy-pages`): private anonymous memory that is
/// not a stack.
pub const PE_LAZY: u32 = 1 << 1;
/// The pages are in this checkpoint's page image.
pub const PE_PRESENT: u32 = 1 << 2;

/// One `pagemap_entry`: `nr_pages` pages from `vaddr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagemapEntry {
    pub vaddr: u64,
    pub nr_pages: u64,
    pub flags: u32,
}

/// A parsed `pagemap-PID.img`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pagemap {
    /// The page image is `pages-<pages_id>.img`.
    pub pages_id: u32,
    pub entries: Vec<PagemapEntry>,
}

impl Pagemap {
    pub fn pages_file(&self) -> String {
        format!("pages-{}.img", self.pages_id)
    }
}

/// The messages of a CRIU image.
fn messages(bytes: &[u8]) -> Result<Vec<&[u8]>, String> {
    let word = |at: usize| -> Option<u32> {
        bytes
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    if word(0) != Some(IMG_COMMON_MAGIC) || word(4).is_none() {
        return Err("not a CRIU image (no image magic)".into());
    }
    let mut at = 8;
    let mut out = Vec::new();
    while at < bytes.len() {
        let len = word(at).ok_or("truncated entry length")? as usize;
        let msg = bytes
            .get(at + 4..at + 4 + len)
            .ok_or_else(|| format!("entry at byte {at} runs past the end"))?;
        out.push(msg);
        at += 4 + len;
    }
    Ok(out)
}

/// Walks a message's fields: `f(field number, wire type, stream)` reads the fields it wants and returns
/// `false` for the others, which are skipped.
fn fields(
    msg: &[u8],
    mut f: impl FnMut(u32, WireType, &mut CodedInputStream<'_>) -> protobuf::Result<bool>,
) -> Result<(), String> {
    let mut is = CodedInputStream::from_bytes(msg);
    let bad = |e: protobuf::Error| format!("bad protobuf message: {e}");
    while let Some(tag) = is.read_raw_tag_or_eof().map_err(bad)? {
        let wire = WireType::new(tag & 7)
            .ok_or_else(|| format!("bad protobuf message: wire type {}", tag & 7))?;
        if !f(tag >> 3, wire, &mut is).map_err(bad)? {
            is.skip_field(wire).map_err(bad)?;
        }
    }
    Ok(())
}

/// Parses `pagemap-PID.img`.
pub fn parse_pagemap(bytes: &[u8]) -> Result<Pagemap, String> {
    let msgs = messages(bytes)?;
    let (head, rest) = msgs.split_first().ok_or("no pagemap head")?;
    let mut pages_id = None;
    fields(head, |n, _, is| {
        Ok(match n {
            1 => {
                pages_id = Some(is.read_uint32()?);
                true
            }
            _ => false,
        })
    })?;
    let pages_id = pages_id.ok_or("pagemap head without pages_id")?;
    let mut entries = Vec::with_capacity(rest.len());
    for msg in rest {
        let (mut vaddr, mut compat, mut nr, mut flags) = (None, None, None, 0);
        fields(msg, |n, _, is| {
            Ok(match n {
                1 => {
                    vaddr = Some(is.read_uint64()?);
                    true
                }
                2 => {
                    compat = Some(is.read_uint32()? as u64);
                    true
                }
                // `in_parent` (3) predates the flags and is implied by PE_PARENT in them.
                4 => {
                    flags = is.read_uint32()?;
                    true
                }
                5 => {
                    nr = Some(is.read_uint64()?);
                    true
                }
                _ => false,
            })
        })?;
        entries.push(PagemapEntry {
            vaddr: vaddr.ok_or("pagemap entry without vaddr")?,
            // `nr_pages` (5) replaced the 32-bit `compat_nr_pages` (2) for huge entries.
            nr_pages: nr.or(compat).ok_or("pagemap entry without nr_pages")?,
            flags,
        });
    }
    Ok(Pagemap { pages_id, entries })
}

/// `vma_entry.status` bits (criu/include/image.h).
/// A mapping CRIU itself understands (not one it refused to dump).
pub const VMA_AREA_REGULAR: u32 = 1 << 0;
pub const VMA_FILE_PRIVATE: u32 = 1 << 6;
pub const VMA_ANON_PRIVATE: u32 = 1 << 9;
pub const VMA_AREA_AIORING: u32 = 1 << 13;
pub const VMA_AREA_SHSTK: u32 = 1 << 15;
/// Not a mapping: pages guarded with `MADV_GUARD_INSTALL`, recorded after every mapping.
pub const VMA_AREA_GUARD: u32 = 1 << 16;

/// One `vma_entry` of `mm-PID.img`: the mapping `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vma {
    pub start: u64,
    pub end: u64,
    /// The file's id for a file mapping.
    pub shmid: u64,
    /// `mmap` flags (`MAP_PRIVATE`, `MAP_ANONYMOUS`, ...).
    pub flags: u32,
    /// CRIU's own bits (`VMA_*`).
    pub status: u32,
    /// The `madvise` advice the mapping had, one bit per advice (`1 << MADV_HUGEPAGE`, ...).
    pub madv: u64,
}

impl Vma {
    /// A guard area, not a mapping (`VMA_AREA_GUARD`).
    pub fn is_guard(&self) -> bool {
        self.status & VMA_AREA_GUARD != 0
    }

    /// Private memory in CRIU's sense (criu/include/vma.h, `vma_entry_is_private`): what it premaps
    /// and fills itself, and what a child may share with its parent.
    pub fn is_private(&self) -> bool {
        (self.status & VMA_AREA_REGULAR != 0
            && self.status & (VMA_ANON_PRIVATE | VMA_FILE_PRIVATE) != 0)
            || self.status & (VMA_AREA_SHSTK | VMA_AREA_AIORING) != 0
    }
}

/// A parsed `mm-PID.img`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mm {
    /// The id of the executable's file: CRIU pairs a child's mappings with its parent's only when both
    /// run the same one.
    pub exe_file_id: u32,
    /// In the image's order: the mappings by address, then the guard areas.
    pub vmas: Vec<Vma>,
}

impl Mm {
    /// The mappings' bounds (`[start, end)`, in address order; no guard area).
    pub fn bounds(&self) -> Vec<(u64, u64)> {
        let mut b: Vec<(u64, u64)> = self
            .vmas
            .iter()
            .filter(|v| !v.is_guard())
            .map(|v| (v.start, v.end))
            .collect();
        b.sort_unstable();
        b
    }
}

/// Parses `mm-PID.img`.
pub fn parse_mm(bytes: &[u8]) -> Result<Mm, String> {
    let (exe_file_id, vmas) = mm_entries(bytes)?;
    Ok(Mm {
        exe_file_id,
        vmas: vmas.into_iter().map(|(v, _)| v).collect(),
    })
}

/// The mappings of `mm-PID.img` with their protection (`PROT_*`), in the image's order.
pub fn parse_mm_protections(bytes: &[u8]) -> Result<Vec<(Vma, u32)>, String> {
    mm_entries(bytes).map(|(_, vmas)| vmas)
}

/// `exe_file_id` and every `vma_entry` (with its `prot`) of `mm-PID.img`.
fn mm_entries(bytes: &[u8]) -> Result<(u32, Vec<(Vma, u32)>), String> {
    let msgs = messages(bytes)?;
    let mm = msgs.first().ok_or("empty mm image")?;
    let mut vmas = Vec::new();
    let mut exe_file_id = 0;
    let mut bad = None;
    fields(mm, |n, _, is| {
        if n == 12 {
            exe_file_id = is.read_uint32()?;
            return Ok(true);
        }
        if n != 14 {
            return Ok(false);
        }
        let vma = is.read_bytes()?;
        let (mut start, mut end, mut shmid, mut flags, mut status, mut madv) =
            (None, None, 0, 0, 0, 0);
        let mut prot = 0;
        if let Err(e) = fields(&vma, |n, _, is| {
            Ok(match n {
                1 => {
                    start = Some(is.read_uint64()?);
                    true
                }
                2 => {
                    end = Some(is.read_uint64()?);
                    true
                }
                4 => {
                    shmid = is.read_uint64()?;
                    true
                }
                5 => {
                    prot = is.read_uint32()?;
                    true
                }
                6 => {
                    flags = is.read_uint32()?;
                    true
                }
                7 => {
                    status = is.read_uint32()?;
                    true
                }
                9 => {
                    madv = is.read_uint64()?;
                    true
                }
                _ => false,
            })
        }) {
            bad.get_or_insert(e);
        }
        match (start, end) {
            (Some(start), Some(end)) if start < end => vmas.push((
                Vma {
                    start,
                    end,
                    shmid,
                    flags,
                    status,
                    madv,
                },
                prot,
            )),
            _ => {
                bad.get_or_insert("a mapping without bounds".to_string());
            }
        }
        Ok(true)
    })?;
    if let Some(e) = bad {
        return Err(e);
    }
    Ok((exe_file_id, vmas))
}

/// A pagemap image holding `entries`, written as CRIU writes them (`compat_nr_pages` 0, the count in
/// `nr_pages`, the flags), behind `original`'s magic words and head message. For a restore that leaves
/// other pages to userfaultfd than the dump recorded; `original` is the pagemap image it replaces.
pub fn write_pagemap(original: &[u8], entries: &[PagemapEntry]) -> Result<Vec<u8>, String> {
    let head = *messages(original)?.first().ok_or("no pagemap head")?;
    // `messages` checked that both magic words are there.
    let magic = u32::from_le_bytes([original[4], original[5], original[6], original[7]]);
    let mut msgs = vec![head.to_vec()];
    for e in entries {
        let mut m = Vec::new();
        encode::uint(1, e.vaddr, &mut m);
        encode::uint(2, 0, &mut m); // required; readers take `nr_pages` when it is there
        encode::uint(4, e.flags as u64, &mut m);
        encode::uint(5, e.nr_pages, &mut m);
        msgs.push(m);
    }
    Ok(image_of_type(magic, &msgs))
}

/// One process of `pstree.img`: its PID, parent, and the IDs of its threads (the main thread's is the PID).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PstreeEntry {
    pub pid: u32,
    pub ppid: u32,
    pub threads: Vec<u32>,
}

/// Parses `pstree.img` (`images/pstree.proto`: pid 1, ppid 2, pgid 3, sid 4, repeated threads 5). CRIU
/// restores every thread under its recorded ID too, so a restore needs all of them free, not only the PIDs.
pub fn parse_pstree(bytes: &[u8]) -> Result<Vec<PstreeEntry>, String> {
    let mut out = Vec::new();
    for msg in messages(bytes)? {
        let (mut pid, mut ppid, mut threads) = (None, 0, Vec::new());
        fields(msg, |n, wire, is| {
            Ok(match (n, wire) {
                (1, _) => {
                    pid = Some(is.read_uint32()?);
                    true
                }
                (2, _) => {
                    ppid = is.read_uint32()?;
                    true
                }
                (5, WireType::LengthDelimited) => {
                    is.read_repeated_packed_uint32_into(&mut threads)?;
                    true
                }
                (5, _) => {
                    threads.push(is.read_uint32()?);
                    true
                }
                _ => false,
            })
        })?;
        out.push(PstreeEntry {
            pid: pid.ok_or("pstree entry without pid")?,
            ppid,
            threads,
        });
    }
    Ok(out)
}

/// Encoding, for tests and the fake CRIU: a CRIU image of `msgs` (the type magic is not checked on
/// reading).
#[cfg(test)]
pub(crate) fn image(msgs: &[Vec<u8>]) -> Vec<u8> {
    image_of_type(0x1234_5678, msgs)
}

/// A CRIU image of type `magic` holding `msgs`.
fn image_of_type(magic: u32, msgs: &[Vec<u8>]) -> Vec<u8> {
    let mut out = IMG_COMMON_MAGIC.to_le_bytes().to_vec();
    out.extend_from_slice(&magic.to_le_bytes());
    for m in msgs {
        out.extend_from_slice(&(m.len() as u32).to_le_bytes());
        out.extend_from_slice(m);
    }
    out
}

pub(crate) mod encode {
    //! Just enough protobuf encoding for the pagemaps a restore writes, and to build test images (and
    //! the fake CRIU's).
    pub fn varint(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    pub fn uint(field: u32, v: u64, out: &mut Vec<u8>) {
        varint((field as u64) << 3, out);
        varint(v, out);
    }
    #[cfg(test)]
    pub fn bytes(field: u32, b: &[u8], out: &mut Vec<u8>) {
        varint(((field as u64) << 3) | 2, out);
        varint(b.len() as u64, out);
        out.extend_from_slice(b);
    }
    #[cfg(test)]
    pub fn pagemap_head(pages_id: u32) -> Vec<u8> {
        let mut m = Vec::new();
        uint(1, pages_id as u64, &mut m);
        m
    }
    #[cfg(test)]
    pub fn pagemap_entry(vaddr: u64, nr_pages: u64, flags: u32) -> Vec<u8> {
        let mut m = Vec::new();
        uint(1, vaddr, &mut m);
        uint(2, nr_pages, &mut m);
        uint(4, flags as u64, &mut m);
        m
    }
    /// An mm entry whose mappings are private anonymous memory.
    #[cfg(test)]
    pub fn mm(vmas: &[(u64, u64)]) -> Vec<u8> {
        let anon: Vec<super::Vma> = vmas
            .iter()
            .map(|&(start, end)| super::Vma {
                start,
                end,
                shmid: 0,
                flags: (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u32,
                status: super::VMA_AREA_REGULAR | super::VMA_ANON_PRIVATE,
                madv: 0,
            })
            .collect();
        mm_of(1, &anon)
    }
    #[cfg(test)]
    pub fn mm_of(exe_file_id: u32, vmas: &[super::Vma]) -> Vec<u8> {
        let rw = (libc::PROT_READ | libc::PROT_WRITE) as u32;
        let with_prot: Vec<(super::Vma, u32)> = vmas.iter().map(|v| (*v, rw)).collect();
        mm_with_prot(exe_file_id, &with_prot)
    }

    /// An mm message whose mappings have the given protections.
    #[cfg(test)]
    pub fn mm_with_prot(exe_file_id: u32, vmas: &[(super::Vma, u32)]) -> Vec<u8> {
        let mut m = Vec::new();
        uint(1, 0x400000, &mut m);
        uint(12, exe_file_id as u64, &mut m);
        for (v, prot) in vmas {
            let mut e = Vec::new();
            uint(1, v.start, &mut e);
            uint(2, v.end, &mut e);
            uint(3, 0, &mut e);
            uint(4, v.shmid, &mut e);
            uint(5, *prot as u64, &mut e);
            uint(6, v.flags as u64, &mut e);
            uint(7, v.status as u64, &mut e);
            if v.madv != 0 {
                uint(9, v.madv, &mut e);
            }
            bytes(14, &e, &mut m);
        }
        uint(15, 1, &mut m);
        m
    }
}

#[cfg(test)]
mod tests {
    use super::encode::*;
    use super::*;

    #[test]
    fn reads_thread_ids_of_a_pstree() {
        let mut one = Vec::new();
        uint(1, 100, &mut one);
        uint(2, 1, &mut one);
        uint(3, 100, &mut one);
        for t in [100, 101, 102] {
            uint(5, t, &mut one);
        }
        uint(9, 7, &mut one); // a field added by a later CRIU
        let mut two = Vec::new();
        uint(1, 103, &mut two);
        uint(2, 100, &mut two);
        bytes(5, &[103], &mut two); // packed
        let got = parse_pstree(&image(&[one, two])).unwrap();
        assert_eq!(
            got,
            [
                PstreeEntry {
                    pid: 100,
                    ppid: 1,
                    threads: vec![100, 101, 102]
                },
                PstreeEntry {
                    pid: 103,
                    ppid: 100,
                    threads: vec![103]
                },
            ]
        );
        assert!(parse_pstree(b"junk").is_err());
    }

    #[test]
    fn reads_a_pagemap_and_skips_unknown_fields() {
        let mut entry = pagemap_entry(0x7f00_0000_0000, 3, PE_PRESENT | PE_LAZY);
        uint(9, 77, &mut entry); // a field from some later CRIU
        bytes(10, b"xyz", &mut entry);
        let mut big = pagemap_entry(0x1000, 0, PE_PRESENT);
        uint(5, 1 << 33, &mut big); // `nr_pages` wins over `compat_nr_pages`
        let img = image(&[pagemap_head(7), entry, big]);
        let pm = parse_pagemap(&img).unwrap();
        assert_eq!(pm.pages_id, 7);
        assert_eq!(pm.pages_file(), "pages-7.img");
        assert_eq!(
            pm.entries,
            vec![
                PagemapEntry {
                    vaddr: 0x7f00_0000_0000,
                    nr_pages: 3,
                    flags: PE_PRESENT | PE_LAZY
                },
                PagemapEntry {
                    vaddr: 0x1000,
                    nr_pages: 1 << 33,
                    flags: PE_PRESENT
                },
            ]
        );
    }

    #[test]
    fn reads_the_mappings_of_an_mm_image() {
        let img = image(&[mm(&[(0x3000, 0x5000), (0x1000, 0x2000)])]);
        assert_eq!(
            parse_mm(&img).unwrap().bounds(),
            vec![(0x1000, 0x2000), (0x3000, 0x5000)]
        );
        let file = Vma {
            start: 0x1000,
            end: 0x2000,
            shmid: 7,
            flags: libc::MAP_PRIVATE as u32,
            status: VMA_AREA_REGULAR | VMA_FILE_PRIVATE,
            madv: 1 << libc::MADV_HUGEPAGE,
        };
        let guard = Vma {
            start: 0x1000,
            end: 0x1000 + 4096,
            shmid: 0,
            flags: 0,
            status: VMA_AREA_GUARD,
            madv: 0,
        };
        let mm = parse_mm(&image(&[mm_of(42, &[file, guard])])).unwrap();
        assert_eq!(mm.exe_file_id, 42);
        assert_eq!(mm.vmas, vec![file, guard]);
        assert!(mm.vmas[0].is_private() && !mm.vmas[0].is_guard());
        assert!(mm.vmas[1].is_guard() && !mm.vmas[1].is_private());
        assert_eq!(
            mm.bounds(),
            vec![(0x1000, 0x2000)],
            "a guard area is no mapping"
        );
    }

    #[test]
    fn a_rewritten_pagemap_reads_back_with_its_head_and_magic() {
        let mut original = image(&[pagemap_head(5), pagemap_entry(0x1000, 3, PE_PRESENT)]);
        original[4..8].copy_from_slice(&0x5608_4025u32.to_le_bytes()); // PAGEMAP_MAGIC
        let entries = [
            PagemapEntry {
                vaddr: 0x1000,
                nr_pages: 1,
                flags: PE_PRESENT,
            },
            PagemapEntry {
                vaddr: 0x2000,
                nr_pages: 1 << 33,
                flags: PE_PRESENT | PE_LAZY,
            },
        ];
        let out = write_pagemap(&original, &entries).unwrap();
        assert_eq!(out[..8], original[..8]);
        let pm = parse_pagemap(&out).unwrap();
        assert_eq!(pm.pages_id, 5);
        assert_eq!(pm.entries, entries);
        assert!(write_pagemap(b"junk", &entries).is_err());
    }

    #[test]
    fn damaged_images_are_errors_not_panics() {
        assert!(parse_pagemap(b"").is_err());
        assert!(parse_pagemap(&[0u8; 8]).is_err(), "no magic");
        let img = image(&[pagemap_head(1), pagemap_entry(0x1000, 1, PE_PRESENT)]);
        for cut in 9..img.len() {
            let _ = parse_pagemap(&img[..cut]); // must not panic
        }
        assert!(parse_pagemap(&img[..img.len() - 1]).is_err());
        let mut no_vaddr = Vec::new();
        uint(2, 1, &mut no_vaddr);
        assert!(parse_pagemap(&image(&[pagemap_head(1), no_vaddr])).is_err());
        let mut bad_vma = Vec::new();
        bytes(14, &[0x08, 0x10], &mut bad_vma); // start only
        assert!(parse_mm(&image(&[bad_vma])).is_err());
        assert!(parse_mm(&image(&[vec![0x0f]])).is_err(), "bad wire type");
    }
}
