//! FIX messages as the adapter reads them: the fields of a message in wire order (repeating
//! groups stay readable without a data dictionary), and the few value formats it writes.

/// A message's fields, in the order they came.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Fields(pub Vec<(u32, String)>);

impl Fields {
    /// Splits a message's wire text (fields separated by SOH).
    pub fn parse(text: &str) -> Fields {
        Fields(
            text.split('\u{1}')
                .filter_map(|f| {
                    let (tag, value) = f.split_once('=')?;
                    Some((tag.parse().ok()?, value.to_string()))
                })
                .collect(),
        )
    }

    pub fn get(&self, tag: u32) -> Option<&str> {
        self.0
            .iter()
            .find(|(t, _)| *t == tag)
            .map(|(_, v)| v.as_str())
    }

    /// Every value of `tag`, in order (the members of a repeating group).
    pub fn all(&self, tag: u32) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(t, _)| *t == tag)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    pub fn number(&self, tag: u32) -> Option<f64> {
        self.get(tag)?.parse().ok().filter(|v: &f64| v.is_finite())
    }

    pub fn integer(&self, tag: u32) -> Option<i64> {
        self.get(tag)?.parse().ok()
    }

    pub fn msg_type(&self) -> &str {
        self.get(35).unwrap_or("")
    }

    /// The members of the repeating group whose entries start at `first` tag: each member's
    /// fields up to the next `first`.
    pub fn group(&self, first: u32) -> Vec<Fields> {
        let mut out: Vec<Fields> = Vec::new();
        for (tag, value) in &self.0 {
            if *tag == first {
                out.push(Fields::default());
            }
            if let Some(member) = out.last_mut() {
                member.0.push((*tag, value.clone()));
            }
        }
        out
    }
}

/// A FIX UTCTimestamp (`YYYYMMDD-HH:MM:SS.sss`) for Unix milliseconds.
pub fn utc_timestamp(unix_ms: i64) -> String {
    let secs = unix_ms.div_euclid(1000);
    let millis = unix_ms.rem_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}-{:02}:{:02}:{:02}.{millis:03}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Unix milliseconds of a FIX UTCTimestamp (`YYYYMMDD-HH:MM:SS[.sss]`); `None` if it is not one.
pub fn parse_utc_timestamp(text: &str) -> Option<i64> {
    let b = text.as_bytes();
    if b.len() < 17 || b[8] != b'-' || b[11] != b':' || b[14] != b':' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| text.get(r)?.parse::<i64>().ok();
    let (y, m, d) = (num(0..4)?, num(4..6)?, num(6..8)?);
    let (hh, mm, ss) = (num(9..11)?, num(12..14)?, num(15..17)?);
    let millis = match text.get(17..) {
        Some("") | None => 0,
        Some(frac) => {
            let digits = frac.strip_prefix('.')?;
            let ms: String = digits.chars().chain("000".chars()).take(3).collect();
            ms.parse::<i64>().ok()?
        }
    };
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    // Days since 1970-01-01 from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86_400 + hh * 3600 + mm * 60 + ss) * 1000 + millis)
}

/// A quantity or price as FIX writes it: no exponent, no trailing zeros.
pub fn decimal(value: f64) -> String {
    let text = format!("{value:.8}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    if text.is_empty() || text == "-" {
        "0".into()
    } else {
        text.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_split_at_their_first_tag() {
        let f = Fields::parse(
            "35=y\u{1}146=2\u{1}55=EURUSD\u{1}231=100000\u{1}55=XAUUSD\u{1}231=100\u{1}10=000\u{1}",
        );
        let g = f.group(55);
        assert_eq!(g.len(), 2);
        assert_eq!(g[1].get(55), Some("XAUUSD"));
        assert_eq!(g[1].number(231), Some(100.0));
        assert_eq!(f.msg_type(), "y");
    }

    #[test]
    fn timestamps_and_decimals_are_fix_formatted() {
        assert_eq!(utc_timestamp(0), "19700101-00:00:00.000");
        assert_eq!(utc_timestamp(1_796_000_123_456), "20261130-00:55:23.456");
        for ms in [0, 951_782_400_000, 1_796_000_123_456, 4_107_542_399_999] {
            assert_eq!(parse_utc_timestamp(&utc_timestamp(ms)), Some(ms), "{ms}");
        }
        assert_eq!(
            parse_utc_timestamp("20261130-00:55:23"),
            Some(1_796_000_123_000)
        );
        assert_eq!(parse_utc_timestamp("2026-11-30 00:55"), None);
        assert_eq!(decimal(20000.0), "20000");
        assert_eq!(decimal(0.25), "0.25");
        assert_eq!(decimal(1.1001), "1.1001");
    }
}
