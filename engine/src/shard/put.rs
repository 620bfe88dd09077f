//! The PUT's entry into the shard: which path a block takes (through a RAM
//! slot, through a DMA buffer, into RAM only with write-back) and, for a
//! block in a client's memory, that the memory is read exactly once
//! (docs/LOCAL.md, "Writes in place"). The log write is `append.rs`; RAM
//! placement `placement.rs`.

use std::sync::Arc;

use bytes::Bytes;

use super::transit::Placed;
use super::{PutOutcome, Shard};
use crate::counter::bump;
use crate::error::{Error, Result};
use crate::key::{BlockHash, StoredKey};
use crate::tier::WritePolicy;

/// Asked by a PUT of a same-host client's memory once the owning shard
/// has read the block out of it, into memory of its own, and before
/// anything is stored: `false` when the client gave up on that memory
/// meanwhile (it closed its connection, or unregistered the buffer:
/// docs/LOCAL.md, "When a client gives up"). The PUT then fails with
/// [`Error::Cancelled`] and stores nothing.
pub type StillWanted = Arc<dyn Fn() -> bool + Send + Sync>;

/// Whose memory a PUT's chunks are, which decides how often they may be
/// read.
#[derive(Clone)]
pub enum PutSource {
    /// The server's own memory (an HTTP body, a copy): read as often as the
    /// write needs (the log, the RAM tier, the remote tier).
    Owned,
    /// A same-host client's registered memory, which the client may write
    /// again at any time (`PUT_FROM`, docs/LOCAL.md "Writes in place"):
    /// read exactly once, into memory the server owns (a RAM-tier slot, else
    /// a copy), before anything is stored, so what the client writes there
    /// later changes nothing stored; and stored only if the client still
    /// wants it ([`StillWanted`]) once that copy is made.
    ClientMemory(StillWanted),
}

impl PutSource {
    /// Whether the chunks are a client's memory.
    pub fn is_client_memory(&self) -> bool {
        matches!(self, PutSource::ClientMemory(_))
    }

    /// After the one read of a client's memory: [`Error::Cancelled`] when
    /// the client gave up on it; always `Ok` for the server's own memory.
    pub(crate) fn check_wanted(&self) -> Result<()> {
        match self {
            PutSource::ClientMemory(wanted) if !wanted() => Err(Error::Cancelled),
            _ => Ok(()),
        }
    }
}

impl std::fmt::Debug for PutSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_client_memory() { "ClientMemory" } else { "Owned" })
    }
}

impl Shard {
    /// Stores a block. `chunks` together must be exactly `block_bytes` long.
    /// Write-through with a RAM tier (and no GPU tier): copied once, into a
    /// RAM slot, and written to the log straight from it
    /// ([`Shard::put_through_ram`]); where no slot can be had, or without a
    /// RAM tier, written to the log (one copy, into the aligned buffer
    /// written), then copied into the RAM tier. Write-back: copied into the
    /// RAM tier only, and acknowledged; to the log when RAM has no slot to
    /// give (every slot pinned by responses in flight).
    ///
    /// # Errors
    /// [`Error::WrongSize`], [`Error::DiskFull`], [`Error::Io`] (write-back:
    /// also from writing a demoted block to the log to make room).
    pub async fn put(&self, key: &StoredKey, hash: BlockHash, chunks: &[Bytes]) -> Result<PutOutcome> {
        self.put_from(key, hash, chunks, &PutSource::Owned).await
    }

    /// Whether a PUT copies its block once, into a RAM slot, and writes the
    /// log from there ([`Shard::put_through_ram`]).
    fn puts_through_ram(&self) -> bool {
        self.cfg.write_policy == WritePolicy::Through && self.gpu.is_none() && self.writes_from_ram()
    }

    /// Write-through with no memory tier: a PUT is a log write only.
    fn log_only_through(&self) -> bool {
        self.cfg.write_policy == WritePolicy::Through && self.gpu.is_none() && self.ram.is_none()
    }

    /// [`Shard::put`] of chunks in `source`'s memory: a client's memory is
    /// read once, into a RAM slot where [`Shard::put_through_ram`] takes
    /// the block, else into a copy that the rest of the write reads.
    /// A client's memory is stored only if the client still wants it once
    /// it was read ([`PutSource::ClientMemory`]).
    ///
    /// # Errors
    /// As [`Shard::put`]; [`Error::Cancelled`] when the client gave up on
    /// its memory before the block was stored (nothing stored).
    pub(crate) async fn put_from(&self, key: &StoredKey, hash: BlockHash, chunks: &[Bytes], source: &PutSource) -> Result<PutOutcome> {
        let block_bytes = self.cfg.geometry.block_bytes;
        let got: u64 = chunks.iter().map(|c| c.len() as u64).sum();
        if got != block_bytes {
            return Err(Error::WrongSize { expected: block_bytes, got });
        }
        // A shard without a log takes no PUT, in any write policy: a
        // write-back block would live in RAM only.
        if self.cfg.log_absent.is_some() {
            self.log_accepts_writes()?;
        }
        if self.puts_through_ram() {
            if let Some(put) = self.put_through_ram(key, hash, chunks, source).await {
                return put;
            }
        }
        let copy;
        let chunks = match source {
            PutSource::Owned => chunks,
            // No RAM slot to give (all pinned or taken by writes in flight),
            // or no memory tier at all: the log's DMA buffer is the one
            // copy; RAM is left without the block rather than copy the
            // client's memory a second time.
            PutSource::ClientMemory(_) if self.puts_through_ram() || self.log_only_through() => {
                let outcome = self.put_nvme_from(key, hash, chunks, true, source).await?;
                // As the copying path's `NoRoom`: an older copy in memory must
                // not outlive the new block, nor an older PUT still on its way
                // there (beginning a transit supersedes it; nothing awaits
                // before it ends, so no GET can see its empty parts).
                let _ticket = self.transits.begin(key, hash, Vec::new());
                self.drop_from_memory(&hash);
                return Ok(outcome);
            }
            PutSource::ClientMemory(_) => {
                copy = owned_copy(chunks);
                source.check_wanted()?;
                &copy[..]
            }
        };
        let parts: Vec<&[u8]> = chunks.iter().map(|c| &c[..]).collect();
        let tiered = self.ram.is_some() || self.gpu.is_some();
        // From here until the block is placed, GETs are served from its
        // transit (see `shard/transit.rs`): in write-back the older copies
        // leave memory before the new one lands, and the log may have none.
        let mut ticket = None;
        if self.cfg.write_policy == WritePolicy::Back && tiered {
            let existed = self.contains(&hash).is_some();
            let t = ticket.insert(self.transits.begin(key, hash, chunks.to_vec()));
            if self.place(key, hash, &parts, true, t).await? != Placed::NoRoom {
                bump(&self.counters.puts, 1);
                return Ok(if existed { PutOutcome::Replaced } else { PutOutcome::Created });
            }
        }
        let outcome = self.put_nvme(key, hash, chunks, true).await?;
        if tiered {
            // Write-through: the transit starts once the log has the block,
            // so transits of concurrent PUTs begin in the order their log
            // writes completed.
            let t = ticket.get_or_insert_with(|| self.transits.begin(key, hash, chunks.to_vec()));
            if self.place(key, hash, &parts, false, t).await? == Placed::NoRoom && t.is_current() {
                // No memory slot to give: an older copy there must not
                // outlive the new block.
                self.drop_from_memory(&hash);
            }
        }
        Ok(outcome)
    }
}

/// Bytes of each piece [`owned_copy`] copies a block into: below jemalloc's
/// `oversize_threshold` (8 MiB), so pieces come back warm from its caches
/// (as the socket's gather, `server/src/local/region.rs`).
const COPY_PIECE_BYTES: usize = 4 << 20;

/// The bytes of `chunks` copied into memory this process owns, in pieces of
/// at most [`COPY_PIECE_BYTES`].
pub(crate) fn owned_copy(chunks: &[Bytes]) -> Vec<Bytes> {
    let mut left: usize = chunks.iter().map(Bytes::len).sum();
    let mut pieces = Vec::with_capacity(left.div_ceil(COPY_PIECE_BYTES));
    let (mut piece, mut want) = (Vec::new(), 0);
    for chunk in chunks {
        let mut rest = &chunk[..];
        while !rest.is_empty() {
            if piece.is_empty() {
                want = left.min(COPY_PIECE_BYTES);
                piece.reserve_exact(want);
            }
            let n = rest.len().min(want - piece.len());
            piece.extend_from_slice(&rest[..n]);
            rest = &rest[n..];
            if piece.len() == want {
                left -= want;
                pieces.push(Bytes::from(std::mem::take(&mut piece)));
            }
        }
    }
    pieces
}

#[cfg(test)]
mod owned_copy_tests {
    use super::*;

    #[test]
    fn an_owned_copy_is_the_same_bytes_in_pieces_of_at_most_4_mib() {
        let bytes: Vec<u8> = (0..(9 << 20) + 12_345).map(|i: u32| (i % 251) as u8).collect();
        // Chunks that cross the pieces' boundaries, and one empty chunk.
        let cuts = [0, 1, 3 << 20, (3 << 20) + 7, 3 << 20 << 1, bytes.len()];
        let mut chunks: Vec<Bytes> = cuts.windows(2).map(|w| Bytes::copy_from_slice(&bytes[w[0]..w[1]])).collect();
        chunks.insert(2, Bytes::new());
        let copy = owned_copy(&chunks);
        assert_eq!(copy.iter().map(Bytes::len).collect::<Vec<_>>(), [4 << 20, 4 << 20, (1 << 20) + 12_345]);
        assert_eq!(copy.concat(), bytes);
        assert!(copy.iter().all(|p| chunks.iter().all(|c| c.is_empty() || p.as_ptr() != c.as_ptr())), "copied, not shared");
        assert!(owned_copy(&[]).is_empty());
    }
}
