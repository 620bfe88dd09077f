//! The response body of every route: a buffer sent whole, or a block
//! streamed chunk by chunk as the engine verifies it.
//!
//! A streamed block declares its full length (`Content-Length`) up front.
//! If a chunk fails its CRC-32 the body yields an error, and hyper ends the
//! response short of that length: HTTP/2 resets the stream (`RST_STREAM`),
//! HTTP/1.1 closes the connection. A client therefore never receives a
//! complete response holding wrong bytes; it sees a reset, which it treats
//! as a miss (docs/API.md).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::Stream;
use http_body::{Body, Frame, SizeHint};
use kvtier_engine::{BlockBody, ChunkStream};

/// Body of a [`crate::routes::Reply`].
pub enum ReplyBody {
    /// All of it at once (JSON, metrics, a RAM-tier block).
    Full(Option<Bytes>),
    /// A block from the log, chunk by chunk as each is read and verified.
    Chunks(ChunkStream),
}

impl ReplyBody {
    /// A body sent in one frame (none when `bytes` is empty).
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        let bytes = bytes.into();
        ReplyBody::Full((!bytes.is_empty()).then_some(bytes))
    }

    /// An empty body.
    pub fn empty() -> Self {
        ReplyBody::Full(None)
    }

    /// The body of a block read back.
    pub fn block(body: BlockBody) -> Self {
        match body {
            BlockBody::Whole(bytes) => ReplyBody::full(bytes),
            BlockBody::Chunks(chunks) => ReplyBody::Chunks(chunks),
        }
    }
}

impl Body for ReplyBody {
    type Data = Bytes;
    type Error = kvtier_engine::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            ReplyBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            ReplyBody::Chunks(chunks) => match Pin::new(chunks).poll_next(cx) {
                Poll::Ready(Some(Ok(chunk))) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
                Poll::Ready(Some(Err(e))) => {
                    tracing::warn!("block stream reset: {e}");
                    Poll::Ready(Some(Err(e)))
                }
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ReplyBody::Full(bytes) => bytes.is_none(),
            ReplyBody::Chunks(chunks) => chunks.remaining() == 0,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ReplyBody::Full(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
            ReplyBody::Chunks(chunks) => SizeHint::with_exact(chunks.remaining()),
        }
    }
}
