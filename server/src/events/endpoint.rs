//! `--kv-events` and `--kv-events-replay`: `tcp://HOST:PORT` read, checked
//! and bound at start, before the store opens, so a bad flag or a port in
//! use stops the server with a message naming the flag.
//!
//! HOST is an IP address (IPv6 in brackets: `tcp://[::1]:5557`),
//! `localhost`, or `*` (every IPv4 interface, as vLLM writes
//! `tcp://*:5557`). Events name every block this node holds (the engine's
//! block hashes and token ids), so an address other than loopback
//! (127.0.0.0/8, ::1, localhost) is refused unless `--kv-events-public`
//! says it is meant.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};

/// Reads `text`, the value of `flag`, as `tcp://HOST:PORT`; a host other
/// than loopback only when `public`.
///
/// # Errors
/// A message naming `flag`, its value and what is wrong.
pub fn parse(flag: &str, text: &str, public: bool) -> Result<SocketAddr, String> {
    let bad = |why: &str| format!("{flag} {text:?}: {why}");
    let Some(rest) = text.strip_prefix("tcp://") else {
        return Err(bad("expected tcp://HOST:PORT (only TCP endpoints are supported)"));
    };
    let (host, port) = match rest.strip_prefix('[') {
        Some(bracketed) => {
            let (host, after) = bracketed.split_once(']').ok_or_else(|| bad("an IPv6 host opened with [ is not closed with ]"))?;
            let port = after.strip_prefix(':').ok_or_else(|| bad("expected :PORT after the IPv6 host"))?;
            (host, port)
        }
        None => {
            let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("expected tcp://HOST:PORT (no port)"))?;
            if host.contains(':') {
                return Err(bad("write an IPv6 host in brackets: tcp://[::1]:PORT"));
            }
            (host, port)
        }
    };
    let port: u16 = port.parse().map_err(|_| bad(&format!("the port {port:?} is not a number from 0 to 65535")))?;
    let ip = match host {
        "*" => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        "localhost" => IpAddr::V4(Ipv4Addr::LOCALHOST),
        "" => return Err(bad("no host: give an IP address, localhost or *")),
        _ => host.parse().map_err(|_| bad(&format!("{host:?} is not an IP address (give an address, localhost or *)")))?,
    };
    if !ip.is_loopback() && !public {
        return Err(bad(&format!(
            "{ip} is not a loopback address; subscribers learn every block this node holds (engine block hashes and \
             token ids): pass --kv-events-public to publish beyond this host"
        )));
    }
    Ok(SocketAddr::new(ip, port))
}

/// Binds `addr` for `flag` (a listening socket the ZeroMQ socket then
/// accepts on).
///
/// # Errors
/// A message naming `flag` and the address; for a port in use, saying so.
pub fn bind(flag: &str, addr: SocketAddr) -> Result<TcpListener, String> {
    TcpListener::bind(addr).map_err(|e| {
        let hint = if e.kind() == std::io::ErrorKind::AddrInUse { " (the port is in use: another kvtier, or another program)" } else { "" };
        format!("{flag} tcp://{addr}: cannot listen: {e}{hint}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLAG: &str = "--kv-events";

    fn addr(text: &str) -> SocketAddr {
        text.parse().unwrap()
    }

    fn err(text: &str) -> String {
        parse(FLAG, text, false).expect_err(text)
    }

    #[test]
    fn loopback_endpoints_parse() {
        assert_eq!(parse(FLAG, "tcp://127.0.0.1:5557", false).unwrap(), addr("127.0.0.1:5557"));
        assert_eq!(parse(FLAG, "tcp://127.9.0.1:1", false).unwrap(), addr("127.9.0.1:1"));
        assert_eq!(parse(FLAG, "tcp://localhost:5557", false).unwrap(), addr("127.0.0.1:5557"));
        assert_eq!(parse(FLAG, "tcp://[::1]:5557", false).unwrap(), addr("[::1]:5557"));
        assert_eq!(parse(FLAG, "tcp://127.0.0.1:0", false).unwrap().port(), 0);
    }

    #[test]
    fn other_hosts_need_public() {
        for text in ["tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://10.1.2.3:5557", "tcp://[::]:5557"] {
            let e = err(text);
            assert!(e.starts_with("--kv-events ") && e.contains("--kv-events-public") && e.contains("not a loopback"), "{e}");
            assert!(parse(FLAG, text, true).is_ok(), "{text}");
        }
        assert_eq!(parse(FLAG, "tcp://*:5557", true).unwrap(), addr("0.0.0.0:5557"));
    }

    #[test]
    fn malformed_endpoints_say_what_is_wrong() {
        let cases = [
            ("127.0.0.1:5557", "expected tcp://HOST:PORT"),
            ("ipc:///tmp/x", "only TCP"),
            ("tcp://127.0.0.1", "no port"),
            ("tcp://127.0.0.1:", "not a number"),
            ("tcp://127.0.0.1:65536", "not a number"),
            ("tcp://127.0.0.1:x", "not a number"),
            ("tcp://:5557", "no host"),
            ("tcp://kvtier.example:5557", "not an IP address"),
            ("tcp://::1:5557", "brackets"),
            ("tcp://[::1:5557", "not closed"),
            ("tcp://[::1]5557", ":PORT"),
        ];
        for (text, why) in cases {
            let e = err(text);
            assert!(e.contains(FLAG) && e.contains(text) && e.contains(why), "{text}: {e}");
        }
    }

    #[test]
    fn a_port_in_use_is_named() {
        let held = TcpListener::bind("127.0.0.1:0").unwrap();
        let e = bind("--kv-events-replay", held.local_addr().unwrap()).unwrap_err();
        assert!(e.starts_with("--kv-events-replay tcp://127.0.0.1:") && e.contains("in use"), "{e}");
    }
}
