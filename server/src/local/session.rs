//! One same-host connection's state, as its reader, its request tasks and
//! its writer share it: the caller HELLO named, the registered buffers,
//! and the queue of responses to send.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use futures::channel::mpsc;

use super::proto::{self, Code, Header, Op, RESPONSE_BIT};
use super::region::Region;
use super::revoke::Peer;
use super::watch::{Admitted, Stage};
use super::LocalShared;
use crate::service::{Caller, Service};

/// A frame to send and, for a data request, its in-flight permit (given
/// back once the response is on the socket, so a client that stops reading
/// responses stops the server reading its requests).
pub(super) type Outgoing = Option<(Vec<u8>, Option<Admitted>, Option<std::os::fd::OwnedFd>)>;

pub(super) struct Conn {
    pub(super) service: Rc<Service>,
    pub(super) shared: Arc<LocalShared>,
    pub(super) out: mpsc::UnboundedSender<Outgoing>,
    pub(super) said_hello: Cell<bool>,
    /// The protocol version HELLO chose ([`proto::VERSIONS`]): from
    /// [`proto::VERSION_TAGS`] on, PUT items carry block tags.
    pub(super) version: Cell<u32>,
    /// The peer's uid (`SO_PEERCRED`).
    pub(super) peer_uid: u32,
    /// The tenant HELLO named (by token, else by the peer's uid); `None`
    /// without `--tenants`.
    pub(super) caller: RefCell<Caller>,
    pub(super) regions: RefCell<HashMap<u64, Arc<Region>>>,
    /// The client, as copies into and out of its regions see it
    /// (`revoke.rs`).
    pub(super) peer: Arc<Peer>,
    pub(super) next_handle: Cell<u64>,
    /// The leases this connection holds (docs/LOCAL.md, "Leases").
    pub(super) leases: RefCell<super::lease_table::Leases>,
}

impl Conn {
    pub(super) fn send(&self, frame: Vec<u8>, admitted: Option<Admitted>) {
        if let Some(a) = &admitted {
            a.tracked().set_stage(Stage::Queued);
        }
        let _ = self.out.unbounded_send(Some((frame, admitted, None)));
    }

    /// Sends a response frame with `fd` in `SCM_RIGHTS` beside its first
    /// byte (`MAP_ARENA`), and counts it.
    pub(super) fn answer_with_fd(&self, header: Header, body: Vec<u8>, fd: std::os::fd::OwnedFd, started: Instant, admitted: Admitted) {
        admitted.tracked().set_stage(Stage::Queued);
        self.record(Op::from_u8(header.op), None, started, 0, 0);
        let frame = proto::response(header.op | RESPONSE_BIT, header.request_id, 0, 0, &body);
        let _ = self.out.unbounded_send(Some((frame, Some(admitted), Some(fd))));
    }

    pub(super) fn record(&self, op: Option<Op>, code: Option<Code>, started: Instant, bytes_in: u64, bytes_out: u64) {
        let status = match code {
            None => 200,
            Some(c) if c.is_server_side() => 500,
            Some(_) => 400,
        };
        let route = op.map_or(proto::ROUTE_NAMES.len() - 1, |o| o as usize - 1);
        let us = started.elapsed().as_micros() as u64;
        self.shared.stats.record(self.service.store.shard_id(), route, status, us, bytes_in, bytes_out);
    }

    /// The client gave up on the connection (its stream ended), or the
    /// server is closing it: no copy into or out of its memory runs once
    /// this returns, and none starts (docs/LOCAL.md, "When a client gives
    /// up"). Its regions stay in the table until [`Conn::drop_regions`].
    pub(super) fn give_up(&self) {
        self.peer.give_up();
        for region in self.regions.borrow().values() {
            region.revoke();
        }
    }

    /// Forgets the connection's regions; their mappings and descriptors are
    /// let go on the executor's blocking pool ([`release_off_shard`]).
    pub(super) fn drop_regions(&self) {
        let regions = std::mem::take(&mut *self.regions.borrow_mut());
        self.shared.registrations_open.fetch_sub(regions.len() as u64, Ordering::Relaxed);
        self.shared.registered_bytes.fetch_sub(regions.values().map(|r| r.len()).sum(), Ordering::Relaxed);
        release_off_shard(regions.into_values().collect());
    }
}

/// Drops `regions` on the executor's blocking pool, not on the shard's
/// thread: unmapping a client's buffer waits for the process's memory-map
/// lock, and closing the last descriptor of a memory file whose client has
/// exited frees its pages (985 ms and 75 ms on a shard's thread, measured
/// under six vLLMs' memory pressure). A region an item in flight still
/// holds is dropped by that item, once it ends.
pub(super) fn release_off_shard(regions: Vec<Arc<Region>>) {
    if regions.is_empty() {
        return;
    }
    let releasing = glommio::executor().spawn_blocking(move || drop(regions));
    glommio::spawn_local(releasing).detach();
}

impl Conn {
    /// Sends the response to `header`'s request and counts it.
    pub(super) fn answer(
        &self,
        header: Header,
        result: Result<(Vec<u8>, u32), (Code, String)>,
        started: Instant,
        bytes_in: u64,
        bytes_out: u64,
        admitted: Admitted,
    ) {
        let op = Op::from_u8(header.op);
        let frame = match result {
            Ok((body, retry_after_ms)) => {
                self.record(op, None, started, bytes_in, bytes_out);
                proto::response(header.op | RESPONSE_BIT, header.request_id, 0, retry_after_ms, &body)
            }
            Err((code, message)) => {
                self.record(op, Some(code), started, 0, 0);
                proto::failure(header.op, header.request_id, code, &message)
            }
        };
        self.send(frame, Some(admitted));
    }
}
