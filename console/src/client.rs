//! Who a request comes from: its TCP peer, or, only when that peer is a
//! trusted proxy (`Config::trusted_proxies`), the right-most address of
//! `X-Forwarded-For` that is not itself a trusted proxy. A client that is
//! not behind a trusted proxy cannot choose the address it is known by.

use std::net::{IpAddr, SocketAddr};

use axum::http::HeaderMap;
use ipnet::IpNet;

/// The header a proxy appends the address it was reached from to.
const FORWARDED_FOR: &str = "x-forwarded-for";

/// A request's client, as the login throttle and the logs know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Client {
    /// The client's address.
    pub(crate) addr: IpAddr,
    /// The trusted proxy it came through, when `addr` is from
    /// `X-Forwarded-For`.
    pub(crate) via: Option<IpAddr>,
}

/// The trusted proxies: CIDRs (`10.0.0.0/8`, `fd00::/8`) or single
/// addresses; the error names the one that is neither.
pub(crate) fn trusted(list: &[String]) -> Result<Vec<IpNet>, String> {
    list.iter()
        .map(|s| {
            let s = s.trim();
            s.parse::<IpNet>()
                .map(|net| net.trunc())
                .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| {
                    format!("{s:?} is not a CIDR (such as 10.0.0.0/8 or fd00::/8) or an IP address")
                })
        })
        .collect()
}

fn is_trusted(addr: IpAddr, trusted: &[IpNet]) -> bool {
    trusted.iter().any(|net| net.contains(&addr))
}

/// One `X-Forwarded-For` entry: an address, bracketed or with a port too.
fn hop(entry: &str) -> Option<IpAddr> {
    let entry = entry.trim();
    let ip = entry
        .parse::<IpAddr>()
        .ok()
        .or_else(|| entry.parse::<SocketAddr>().ok().map(|a| a.ip()))
        .or_else(|| {
            entry
                .strip_prefix('[')
                .and_then(|e| e.strip_suffix(']'))
                .and_then(|e| e.parse().ok())
        })?;
    Some(ip.to_canonical())
}

/// The client of a request from `peer` with `headers`.
pub(crate) fn client(peer: IpAddr, headers: &HeaderMap, trusted: &[IpNet]) -> Client {
    let peer = peer.to_canonical();
    let direct = Client {
        addr: peer,
        via: None,
    };
    if !is_trusted(peer, trusted) {
        return direct;
    }
    let mut entries = Vec::new();
    for value in headers.get_all(FORWARDED_FOR) {
        let Ok(text) = value.to_str() else {
            return direct;
        };
        entries.extend(text.split(','));
    }
    // Right to left: each trusted proxy appended the address it was reached
    // from. The first one no trusted proxy holds is the client; garbage
    // stops the walk at the proxy that handed it on.
    let mut nearest = peer;
    for entry in entries.iter().rev() {
        match hop(entry) {
            Some(addr) if is_trusted(addr, trusted) => nearest = addr,
            Some(addr) => {
                return Client {
                    addr,
                    via: Some(peer),
                };
            }
            None => break,
        }
    }
    Client {
        addr: nearest,
        via: (nearest != peer).then_some(peer),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn forwarded(values: &[&str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append(FORWARDED_FOR, HeaderValue::from_str(v).unwrap());
        }
        headers
    }

    fn proxies() -> Vec<IpNet> {
        trusted(&["10.0.0.0/8".into(), "fd00::/8".into(), "192.0.2.1".into()]).unwrap()
    }

    #[test]
    fn trusted_proxies_are_cidrs_or_addresses() {
        let nets = trusted(&["10.1.2.3/8".into(), " ::1 ".into()]).unwrap();
        assert_eq!(nets[0].to_string(), "10.0.0.0/8");
        assert_eq!(nets[1].to_string(), "::1/128");
        for bad in ["10.0.0.0/33", "proxy.example", "", "10.0.0.0/8/1"] {
            let err = trusted(&[bad.into()]).unwrap_err();
            assert!(err.contains("is not a CIDR"), "{bad}: {err}");
        }
    }

    #[test]
    fn an_untrusted_peers_header_is_ignored() {
        let spoofed = forwarded(&["203.0.113.9"]);
        let c = client(ip("198.51.100.7"), &spoofed, &proxies());
        assert_eq!(c.addr, ip("198.51.100.7"));
        assert_eq!(c.via, None);
        // With no trusted proxy at all, the same.
        let c = client(ip("10.0.0.5"), &spoofed, &[]);
        assert_eq!(c.addr, ip("10.0.0.5"));
    }

    #[test]
    fn through_trusted_proxies_the_right_most_untrusted_address_is_the_client() {
        let p = proxies();
        // The client put a spoofed address first; the proxies appended theirs.
        let chain = forwarded(&["1.1.1.1, 203.0.113.9", "10.2.0.1"]);
        let c = client(ip("10.0.0.5"), &chain, &p);
        assert_eq!(c.addr, ip("203.0.113.9"));
        assert_eq!(c.via, Some(ip("10.0.0.5")));
        // No header: the proxy itself.
        let c = client(ip("10.0.0.5"), &HeaderMap::new(), &p);
        assert_eq!((c.addr, c.via), (ip("10.0.0.5"), None));
        // Every hop trusted: the left-most.
        let c = client(ip("10.0.0.5"), &forwarded(&["10.9.9.9, 192.0.2.1"]), &p);
        assert_eq!((c.addr, c.via), (ip("10.9.9.9"), Some(ip("10.0.0.5"))));
    }

    #[test]
    fn ipv6_hops_bracketed_with_ports_and_mapped_addresses_are_read() {
        let p = proxies();
        let c = client(ip("fd00::1"), &forwarded(&["2001:db8::7"]), &p);
        assert_eq!(c.addr, ip("2001:db8::7"));
        let c = client(ip("fd00::1"), &forwarded(&["[2001:db8::8]:4711"]), &p);
        assert_eq!(c.addr, ip("2001:db8::8"));
        let c = client(ip("fd00::1"), &forwarded(&["[2001:db8::9]"]), &p);
        assert_eq!(c.addr, ip("2001:db8::9"));
        let c = client(ip("::ffff:10.0.0.5"), &forwarded(&["203.0.113.1:80"]), &p);
        assert_eq!(
            c.addr,
            ip("203.0.113.1"),
            "a v4-mapped peer is its v4 address"
        );
        assert_eq!(c.via, Some(ip("10.0.0.5")));
    }

    #[test]
    fn garbage_stops_at_the_proxy_that_handed_it_on() {
        let p = proxies();
        for junk in ["unknown", "", "1.2.3.4.5", "<script>", "_hidden"] {
            let c = client(ip("10.0.0.5"), &forwarded(&[junk]), &p);
            assert_eq!((c.addr, c.via), (ip("10.0.0.5"), None), "{junk:?}");
        }
        let c = client(
            ip("10.0.0.5"),
            &forwarded(&["203.0.113.9, junk, 10.3.3.3"]),
            &p,
        );
        assert_eq!((c.addr, c.via), (ip("10.3.3.3"), Some(ip("10.0.0.5"))));
        let mut headers = HeaderMap::new();
        headers.insert(
            FORWARDED_FOR,
            HeaderValue::from_bytes(b"\xff1.2.3.4").unwrap(),
        );
        let c = client(ip("10.0.0.5"), &headers, &p);
        assert_eq!((c.addr, c.via), (ip("10.0.0.5"), None));
    }
}
