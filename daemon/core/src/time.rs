//! The one time type at the crates' seams: an instant, in microseconds since the Unix epoch.
//! Core and the engine never read a clock: the service makes instants
//! (`valem_service::time::now`) and gives the engine one per cycle; the engine hands
//! JSONata the milliseconds its `$now()` and `$millis()` speak.

/// An instant: microseconds since 1970-01-01T00:00:00Z (UTC). Serialised as that integer.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(transparent)]
pub struct Timestamp(i64);

impl Timestamp {
    /// The instant `us` microseconds after the epoch.
    pub const fn from_us(us: i64) -> Timestamp {
        Timestamp(us)
    }

    /// The instant `ms` milliseconds after the epoch (saturating past ±292,000 years).
    pub const fn from_ms(ms: i64) -> Timestamp {
        Timestamp(ms.saturating_mul(1000))
    }

    /// Microseconds since the epoch.
    pub const fn us(self) -> i64 {
        self.0
    }

    /// One microsecond later (saturating): the next of strictly increasing instants.
    pub const fn next(self) -> Timestamp {
        Timestamp(self.0.saturating_add(1))
    }

    /// Whole milliseconds since the epoch, truncated toward zero.
    pub const fn ms(self) -> i64 {
        self.0 / 1000
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_convert_and_truncate_toward_zero() {
        let t = Timestamp::from_us(1_767_225_600_123_456);
        assert_eq!(t.ms(), 1_767_225_600_123);
        assert_eq!(Timestamp::from_ms(t.ms()).us(), 1_767_225_600_123_000);
        assert_eq!(Timestamp::from_us(-1_500).ms(), -1);
        assert_eq!(Timestamp::from_ms(i64::MAX).us(), i64::MAX);
        assert!(Timestamp::from_us(1) > Timestamp::default());
    }
}
