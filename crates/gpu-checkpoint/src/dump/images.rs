//! The two CRIU images a userfaultfd restore reads itself: `pagemap-PID.img` (which pages of a process
//! its page image holds, in order, and which of them CRIU may leave to userfaultfd) and `mm-PID.img`
//! (the process's mappings, whose bounds one `UFFDIO_COPY` must not cross).
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

/// The mappings (`[start, end)`, in address order) of `mm-PID.img`.
pub fn parse_vmas(bytes: &[u8]) -> Result<Vec<(u64, u64)>, String> {
    let msgs = messages(bytes)?;
    let mm = msgs.first().ok_or("empty mm image")?;
    let mut vmas = Vec::new();
    let mut bad = None;
    fields(mm, |n, _, is| {
        if n != 14 {
            return Ok(false);
        }
        let vma = is.read_bytes()?;
        let (mut start, mut end) = (None, None);
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
                _ => false,
            })
        }) {
            bad.get_or_insert(e);
        }
        match (start, end) {
            (Some(s), Some(e)) if s < e => vmas.push((s, e)),
            _ => {
                bad.get_or_insert("a mapping without bounds".to_string());
            }
        }
        Ok(true)
    })?;
    if let Some(e) = bad {
        return Err(e);
    }
    vmas.sort_unstable();
    Ok(vmas)
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
pub(crate) fn image(msgs: &[Vec<u8>]) -> Vec<u8> {
    let mut out = IMG_COMMON_MAGIC.to_le_bytes().to_vec();
    out.extend_from_slice(&0x1234_5678u32.to_le_bytes());
    for m in msgs {
        out.extend_from_slice(&(m.len() as u32).to_le_bytes());
        out.extend_from_slice(m);
    }
    out
}

pub(crate) mod encode {
    //! Just enough protobuf encoding to build test images (and the fake CRIU's).
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
    pub fn bytes(field: u32, b: &[u8], out: &mut Vec<u8>) {
        varint(((field as u64) << 3) | 2, out);
        varint(b.len() as u64, out);
        out.extend_from_slice(b);
    }
    pub fn pagemap_head(pages_id: u32) -> Vec<u8> {
        let mut m = Vec::new();
        uint(1, pages_id as u64, &mut m);
        m
    }
    pub fn pagemap_entry(vaddr: u64, nr_pages: u64, flags: u32) -> Vec<u8> {
        let mut m = Vec::new();
        uint(1, vaddr, &mut m);
        uint(2, nr_pages, &mut m);
        uint(4, flags as u64, &mut m);
        m
    }
    pub fn mm(vmas: &[(u64, u64)]) -> Vec<u8> {
        let mut m = Vec::new();
        uint(1, 0x400000, &mut m);
        for &(s, e) in vmas {
            let mut v = Vec::new();
            uint(1, s, &mut v);
            uint(2, e, &mut v);
            uint(3, 0, &mut v);
            bytes(14, &v, &mut m);
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
            parse_vmas(&img).unwrap(),
            vec![(0x1000, 0x2000), (0x3000, 0x5000)]
        );
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
        assert!(parse_vmas(&image(&[bad_vma])).is_err());
        assert!(parse_vmas(&image(&[vec![0x0f]])).is_err(), "bad wire type");
    }
}
