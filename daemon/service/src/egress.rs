//! Which addresses a `server` effect may reach without `--effects-allow-private-ips`: the
//! globally reachable ones. Pure classification of an IP address; never resolves or connects.
//!
//! IPv4: every address outside the special-purpose ranges that are not globally reachable
//! (IANA's registry: this network, private, shared/CGNAT, loopback, link-local, IETF protocol
//! assignments, documentation, the deprecated 6to4 relay anycast, benchmarking, multicast,
//! reserved, broadcast).
//!
//! IPv6: an address that embeds an IPv4 address is judged by that IPv4 address, since a
//! translator or tunnel delivers it there — IPv4-mapped `::ffff:0:0/96`, IPv4-compatible
//! `::/96` (`::` and `::1` included: they embed `0.0.0.0/8`), IPv4-translated
//! `::ffff:0:0:0/96`, NAT64 `64:ff9b::/96`, 6to4 `2002::/16` and Teredo `2001::/32` (its server
//! and its client address must both be public). The local-use NAT64 prefix `64:ff9b:1::/48` is
//! never public (where it embeds an IPv4 address depends on the local prefix length, and IANA
//! lists it as not globally reachable). Anything else is public only inside global unicast
//! `2000::/3` and outside its special ranges there: IETF protocol assignments `2001::/23`
//! (benchmarking `2001:2::/48` and ORCHID among them; the few globally reachable services in
//! it are refused too) and documentation `2001:db8::/32`, `3fff::/20`. Outside `2000::/3` lie
//! the unspecified and loopback addresses, unique-local `fc00::/7`, link-local `fe80::/10`,
//! site-local `fec0::/10`, multicast `ff00::/8`, discard-only `100::/64` and what is not
//! allocated.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// A globally reachable address.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => match embedded_v4(v6) {
            Some(Embedded::One(v4)) => is_public_v4(v4),
            Some(Embedded::Teredo { server, client }) => {
                is_public_v4(server) && is_public_v4(client)
            }
            Some(Embedded::LocalNat64) => false,
            None => is_public_v6(v6),
        },
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(a == 0 // 0.0.0.0/8: this network
        || a == 10 // private
        || (a == 100 && (b & 0xc0) == 64) // 100.64.0.0/10: shared address space (CGNAT)
        || a == 127 // loopback
        || (a == 169 && b == 254) // link-local
        || (a == 172 && (b & 0xf0) == 16) // private
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 192 && b == 0 && c == 2) // TEST-NET-1
        || (a == 192 && b == 88 && c == 99) // 6to4 relay anycast (deprecated)
        || (a == 192 && b == 168) // private
        || (a == 198 && (b & 0xfe) == 18) // 198.18.0.0/15: benchmarking
        || (a == 198 && b == 51 && c == 100) // TEST-NET-2
        || (a == 203 && b == 0 && c == 113) // TEST-NET-3
        || a >= 224) // multicast 224/4, reserved 240/4, broadcast
}

/// An IPv6 address with no IPv4 address embedded in it.
fn is_public_v6(ip: Ipv6Addr) -> bool {
    let s = ip.segments();
    let global_unicast = (s[0] & 0xe000) == 0x2000;
    let ietf = s[0] == 0x2001 && s[1] < 0x0200; // 2001::/23
    let documentation = (s[0] == 0x2001 && s[1] == 0x0db8) || (s[0] == 0x3fff && s[1] < 0x1000);
    global_unicast && !ietf && !documentation
}

/// The IPv4 address(es) an IPv6 address carries, by the forms that embed one.
#[derive(Debug, PartialEq)]
enum Embedded {
    One(Ipv4Addr),
    /// Teredo: the server's address, and the client's (stored inverted).
    Teredo {
        server: Ipv4Addr,
        client: Ipv4Addr,
    },
    /// The local-use NAT64 prefix `64:ff9b:1::/48`.
    LocalNat64,
}

fn embedded_v4(ip: Ipv6Addr) -> Option<Embedded> {
    let s = ip.segments();
    let o = ip.octets();
    let low = Ipv4Addr::new(o[12], o[13], o[14], o[15]);
    let zero = |r: std::ops::Range<usize>| s[r].iter().all(|x| *x == 0);
    if zero(0..5) && (s[5] == 0xffff || s[5] == 0) {
        // ::ffff:a.b.c.d (mapped), ::a.b.c.d (compatible)
        return Some(Embedded::One(low));
    }
    if zero(0..4) && s[4] == 0xffff && s[5] == 0 {
        // ::ffff:0:a.b.c.d (translated)
        return Some(Embedded::One(low));
    }
    match (s[0], s[1]) {
        (0x0064, 0xff9b) if zero(2..6) => Some(Embedded::One(low)),
        (0x0064, 0xff9b) if s[2] == 1 => Some(Embedded::LocalNat64),
        (0x2002, _) => Some(Embedded::One(Ipv4Addr::new(o[2], o[3], o[4], o[5]))),
        (0x2001, 0x0000) => Some(Embedded::Teredo {
            server: Ipv4Addr::new(o[4], o[5], o[6], o[7]),
            client: Ipv4Addr::new(!o[12], !o[13], !o[14], !o[15]),
        }),
        _ => None,
    }
}

/// The host part of a `Host` value (`[::1]:8080` → `[::1]`, `localhost:80` → `localhost`).
pub fn host_name(h: &str) -> &str {
    if let Some(rest) = h.strip_prefix('[') {
        return match rest.find(']') {
            Some(i) => &h[..i + 2],
            None => h,
        };
    }
    h.rsplit_once(':').map_or(h, |(name, _)| name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_judged_by_what_they_reach() {
        let not_public = [
            // IPv4 special ranges
            "0.0.0.0",
            "0.1.2.3",
            "10.1.2.3",
            "100.64.0.1",
            "100.127.255.254",
            "127.0.0.1",
            "127.255.0.1",
            "169.254.169.254",
            "172.16.0.1",
            "172.31.255.255",
            "192.0.0.8",
            "192.0.2.1",
            "192.88.99.1",
            "192.168.1.1",
            "198.18.0.1",
            "198.19.255.255",
            "198.51.100.7",
            "203.0.113.9",
            "224.0.0.1",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            // IPv6 of its own
            "::",
            "::1",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "febf::1",
            "fec0::1",
            "ff02::1",
            "100::1",
            "2001:db8::1",
            "2001:2::1",
            "2001:10::1",
            "3fff::1",
            "5f00::1",
            "4000::1",
            "64:ff9b:1::a00:1",
            "64:ff9b:1::808:808",
            // IPv6 embedding a non-public IPv4
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "::127.0.0.1",
            "::10.0.0.1",
            "::169.254.169.254",
            "::ffff:0:127.0.0.1",
            "64:ff9b::127.0.0.1",
            "64:ff9b::10.0.0.1",
            "64:ff9b::192.168.0.1",
            "64:ff9b::100.64.0.1",
            "2002:7f00:1::",
            "2002:a00:1::1",
            "2002:c0a8:101::",
            "2002:a9fe:a9fe::1",
            // Teredo: a private server, or a private (inverted) client
            "2001:0:a00:1::f7f7:f7f7",
            "2001:0:808:808::80ff:fffe",
        ];
        for a in not_public {
            let ip: IpAddr = a.parse().expect(a);
            assert!(!is_public(ip), "{a} must not be public");
        }
        let public = [
            "8.8.8.8",
            "1.1.1.1",
            "100.63.255.255",
            "100.128.0.1",
            "172.32.0.1",
            "192.0.1.1",
            "198.17.255.255",
            "198.20.0.1",
            "223.255.255.254",
            "2606:4700::1111",
            "2a00:1450:4001::200e",
            "2001:200::1",
            "::ffff:8.8.8.8",
            "::8.8.8.8",
            "::ffff:0:8.8.8.8",
            "64:ff9b::8.8.8.8",
            "2002:808:808::1",
            // Teredo: server 8.8.8.8, client 8.8.4.4 (stored inverted: f7f7:fbfb)
            "2001:0:808:808::f7f7:fbfb",
        ];
        for a in public {
            let ip: IpAddr = a.parse().expect(a);
            assert!(is_public(ip), "{a} must be public");
        }
    }

    #[test]
    fn embedded_addresses_are_found_where_each_form_puts_them() {
        let v6 = |a: &str| a.parse::<Ipv6Addr>().expect(a);
        let v4 = |a: &str| a.parse::<Ipv4Addr>().expect(a);
        assert_eq!(
            embedded_v4(v6("2002:c0a8:101::1")),
            Some(Embedded::One(v4("192.168.1.1")))
        );
        assert_eq!(
            embedded_v4(v6("64:ff9b::7f00:1")),
            Some(Embedded::One(v4("127.0.0.1")))
        );
        assert_eq!(
            embedded_v4(v6("2001:0:4136:e378:8000:63bf:3fff:fdd2")),
            Some(Embedded::Teredo {
                server: v4("65.54.227.120"),
                client: v4("192.0.2.45"),
            })
        );
        assert_eq!(embedded_v4(v6("2606:4700::1111")), None);
    }
}
