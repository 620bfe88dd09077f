//! Frames: the 16-byte header, finding whole frames in a byte stream, and
//! writing request and response frames.

use crate::{Code, HEADER_BYTES, MAGIC, PAYLOAD_BYTES_MAX, RESPONSE_BIT};

/// A frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The operation (a response has [`RESPONSE_BIT`] set).
    pub op: u8,
    /// Payload bytes that follow.
    pub payload_bytes: u32,
    /// Chosen by the client, echoed in the response.
    pub request_id: u64,
}

impl Header {
    /// Decodes a header from its 16 bytes.
    ///
    /// # Errors
    /// A message for the `BAD_FRAME` reply: wrong magic, nonzero flags, or
    /// a payload over [`PAYLOAD_BYTES_MAX`].
    pub fn decode(b: &[u8; HEADER_BYTES]) -> Result<Header, String> {
        let magic = u16::from_le_bytes([b[0], b[1]]);
        if magic != MAGIC {
            return Err(format!("bad frame magic 0x{magic:04x} (expected 0x{MAGIC:04x}, b\"TK\"): not a kvtier local-protocol client?"));
        }
        if b[3] != 0 {
            return Err(format!("frame flags must be 0, got {}", b[3]));
        }
        let payload_bytes = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes"));
        if payload_bytes as usize > PAYLOAD_BYTES_MAX {
            return Err(format!("frame payload of {payload_bytes} bytes is over the limit of {PAYLOAD_BYTES_MAX}"));
        }
        Ok(Header { op: b[2], payload_bytes, request_id: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")) })
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        b[2] = self.op;
        b[4..8].copy_from_slice(&self.payload_bytes.to_le_bytes());
        b[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        b
    }
}

/// What the front of a receive buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// A whole frame: its header and its length, header included, bytes.
    Frame(Header, usize),
    /// Not a whole frame yet: read at least this many more bytes (a whole
    /// header's worth while the header is incomplete).
    Need(usize),
}

/// The frame at the front of `buf`, the one framing rule of the socket's
/// read loop (server/src/local/conn.rs) and of the fuzz target
/// `local_frames`.
///
/// # Errors
/// A connection error (the header's own, [`Header::decode`]): the rest of
/// the stream cannot be framed.
pub fn next_frame(buf: &[u8]) -> Result<Next, String> {
    let Some(head) = buf.get(..HEADER_BYTES) else {
        return Ok(Next::Need(HEADER_BYTES));
    };
    let header = Header::decode(head.try_into().expect("16 bytes"))?;
    let frame_bytes = HEADER_BYTES + header.payload_bytes as usize;
    if buf.len() < frame_bytes {
        return Ok(Next::Need(frame_bytes - buf.len()));
    }
    Ok(Next::Frame(header, frame_bytes))
}

/// A response frame: header, status, retry hint, then the body or message.
pub fn response(op: u8, request_id: u64, status: i32, retry_after_ms: u32, body: &[u8]) -> Vec<u8> {
    let payload_bytes = (8 + body.len()) as u32;
    let mut out = Vec::with_capacity(HEADER_BYTES + payload_bytes as usize);
    out.extend_from_slice(&Header { op, payload_bytes, request_id }.encode());
    out.extend_from_slice(&status.to_le_bytes());
    out.extend_from_slice(&retry_after_ms.to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// A failed request's response: the code and a message naming what was wrong.
pub fn failure(op: u8, request_id: u64, code: Code, message: &str) -> Vec<u8> {
    response(op | RESPONSE_BIT, request_id, code as i32, 0, message.as_bytes())
}

/// A whole frame: header and payload.
pub fn frame(op: u8, request_id: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + payload.len());
    out.extend_from_slice(&Header { op, payload_bytes: payload.len() as u32, request_id }.encode());
    out.extend_from_slice(payload);
    out
}
