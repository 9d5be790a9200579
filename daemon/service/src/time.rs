//! Clocks: wall-clock instants for commit times (epoch microseconds inside, ISO-8601 UTC on
//! the wire) and the coarse monotonic clock that bounds a cycle's time.

use chrono::{DateTime, SecondsFormat, Utc};

pub use valem_core::time::Timestamp;

/// Now, on the wall clock.
pub fn now() -> Timestamp {
    Timestamp::from_us(Utc::now().timestamp_micros())
}

/// ISO-8601 UTC with microseconds (`2026-12-02T18:31:39.123456Z`).
pub fn iso(t: Timestamp) -> String {
    DateTime::<Utc>::from_timestamp_micros(t.us())
        .map(|t| t.to_rfc3339_opts(SecondsFormat::Micros, true))
        .unwrap_or_else(|| t.us().to_string())
}

/// A text that is not an ISO-8601 instant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{text}` is not an ISO-8601 instant (expected e.g. 2026-01-31T12:00:00Z)")]
pub struct NotAnInstant {
    pub text: String,
}

/// ISO-8601 UTC with milliseconds (`2026-12-02T18:31:39.123Z`), as effect statuses show it.
pub fn iso_millis(t: Timestamp) -> String {
    DateTime::<Utc>::from_timestamp_millis(t.ms())
        .map(|t| t.to_rfc3339_opts(SecondsFormat::Millis, true))
        .unwrap_or_default()
}

/// Parse an ISO-8601 instant (RFC 3339: a `Z` or `±hh:mm` offset; a date alone means its
/// midnight UTC) to epoch microseconds.
pub fn parse_iso(s: &str) -> Result<Timestamp, NotAnInstant> {
    let t = s.trim();
    if let Ok(d) = DateTime::parse_from_rfc3339(t) {
        return Ok(Timestamp::from_us(d.with_timezone(&Utc).timestamp_micros()));
    }
    if let Ok(d) = chrono::NaiveDate::parse_from_str(t, "%Y-%m-%d") {
        if let Some(dt) = d.and_hms_opt(0, 0, 0) {
            return Ok(Timestamp::from_us(dt.and_utc().timestamp_micros()));
        }
    }
    Err(NotAnInstant {
        text: s.to_string(),
    })
}

/// A monotonic clock in milliseconds, at the resolution of the kernel's tick (a few ms): read
/// in ~5 ns where a precise one takes ~25 ns, and a cycle's budget is seconds. The engine's
/// [`valem_engine::Clock`] for cycle budgets.
pub fn coarse_ms() -> u64 {
    #[cfg(target_os = "linux")]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC_COARSE exists on every
        // Linux since 2.6.32 and the call only writes `ts`.
        if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) } == 0 {
            return (ts.tv_sec as u64) * 1000 + (ts.tv_nsec as u64) / 1_000_000;
        }
    }
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

/// A cycle budget of `ms` milliseconds on [`coarse_ms`] (`None` for 0: no budget).
pub fn cycle_budget(ms: u64) -> Option<valem_engine::CycleBudget> {
    (ms > 0).then_some(valem_engine::CycleBudget {
        ms,
        clock: coarse_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let us = Timestamp::from_us(1_767_225_600_123_456);
        assert_eq!(iso(us), "2026-01-01T00:00:00.123456Z");
        assert_eq!(parse_iso(&iso(us)), Ok(us));
        assert_eq!(
            parse_iso("2026-01-01T01:00:00+01:00"),
            Ok(Timestamp::from_us(1_767_225_600_000_000))
        );
        assert_eq!(
            parse_iso("2026-01-01"),
            Ok(Timestamp::from_us(1_767_225_600_000_000))
        );
        assert!(parse_iso("yesterday")
            .unwrap_err()
            .to_string()
            .contains("yesterday"));
    }
}
