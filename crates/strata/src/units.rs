//! Human units: sizes like `4GiB`, durations like `60s`.

use std::time::Duration;

pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("bad size {s:?}: expected e.g. 4GiB, 512MiB, 1048576"))?;
    let mul: u64 = match unit {
        "" | "B" => 1,
        "K" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "T" | "TiB" => 1 << 40,
        _ => {
            return Err(format!(
                "bad size unit {unit:?}: use B, KiB, MiB, GiB or TiB"
            ))
        }
    };
    n.checked_mul(mul)
        .filter(|&v| v > 0)
        .ok_or_else(|| format!("size {s:?} is zero or too large"))
}

/// A duration: `humantime`'s syntax (`60s`, `10m`, `2h`, `30d`, `1h 30m`, `250ms`), or a bare
/// number of seconds. Values too large for a `Duration` are refused, not wrapped.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return s
            .parse()
            .map(Duration::from_secs)
            .map_err(|_| format!("duration {s:?} is too large"));
    }
    humantime::parse_duration(s)
        .map_err(|e| format!("bad duration {s:?} ({e}): expected e.g. 60s, 10m, 2h, 30d"))
}

/// A size in a setting: a flag or variable (`4GiB`, `512MiB`, `1048576`, `0`) or a TOML value
/// (the same string, or an integer of bytes).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Size(pub u64);

impl std::str::FromStr for Size {
    type Err = String;
    fn from_str(s: &str) -> Result<Size, String> {
        if s.trim() == "0" {
            return Ok(Size(0));
        }
        parse_size(s).map(Size)
    }
}

/// A duration in a setting: [`parse_duration`]'s syntax, or a TOML integer of seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dur(pub Duration);

impl std::str::FromStr for Dur {
    type Err = String;
    fn from_str(s: &str) -> Result<Dur, String> {
        parse_duration(s).map(Dur)
    }
}

/// How often something runs: a duration, or `off` (also `0`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Every(pub Option<Duration>);

impl std::str::FromStr for Every {
    type Err = String;
    fn from_str(s: &str) -> Result<Every, String> {
        match s.trim() {
            "off" | "0" => Ok(Every(None)),
            s => parse_duration(s).map(|d| Every(Some(d))),
        }
    }
}

/// A setting read from a string, or from a TOML integer (bytes, or seconds).
fn de_str_or_int<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: std::str::FromStr<Err = String>,
{
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Int(u64),
        Str(String),
    }
    let s = match <Raw as serde::Deserialize>::deserialize(d)? {
        Raw::Int(n) => n.to_string(),
        Raw::Str(s) => s,
    };
    s.parse().map_err(serde::de::Error::custom)
}

impl<'de> serde::Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        de_str_or_int(d)
    }
}

impl<'de> serde::Deserialize<'de> for Dur {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        de_str_or_int(d)
    }
}

impl<'de> serde::Deserialize<'de> for Every {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        de_str_or_int(d)
    }
}

// Serialized only to layer settings (flags over the file): back to what parses again.
impl serde::Serialize for Size {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl serde::Serialize for Dur {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(self.0).to_string())
    }
}

impl serde::Serialize for Every {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            None => s.serialize_str("off"),
            Some(d) => s.serialize_str(&humantime::format_duration(d).to_string()),
        }
    }
}

pub fn fmt_size(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations() {
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("-1").is_err());
        assert!(parse_size("4XB").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("99999999999TiB").is_err());
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
        assert!(parse_duration("1x").is_err());
        assert!(parse_duration("").is_err());
        // Used to overflow (a panic in debug builds, a wrapped value in release).
        assert!(parse_duration("99999999999999999999d").is_err());
        assert!(parse_duration("999999999999999999d").is_err());
        assert!(parse_duration("99999999999999999999").is_err());
        assert_eq!(fmt_size(1536), "1.5 KiB");
    }
}
