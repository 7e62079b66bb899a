//! Kubernetes resource quantities (`30`, `20Gi`, `1.5G`, `256Mi`) as exact integers.
//!
//! The scheduler writes `consumedCapacity` as quantities; a limit must come out exact, so the
//! parse is integer-only: a value that is not a whole number of units (`0.5`, `1m`) is an
//! error, never rounded onto a neighbour's memory.

/// Why a quantity was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// Not of the form `<digits>[.<digits>][suffix]`.
    #[error("{0:?} is not a quantity this driver understands (e.g. 30, 20Gi, 512Mi)")]
    Syntax(String),
    /// Negative, fractional or too large.
    #[error("{0:?} is not a whole number of units within range")]
    Range(String),
}

/// The integer value of `text`.
pub fn parse(text: &str) -> Result<u64, QuantityError> {
    let syntax = || QuantityError::Syntax(text.to_owned());
    let range = || QuantityError::Range(text.to_owned());
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, suffix) = t.split_at(split);
    // (multiplier numerator, whether it is binary) per suffix; `m` (milli) would be a fraction.
    let mult: u128 = match suffix {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "E" => 1_000_000_000_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        "m" => return Err(range()),
        _ => return Err(syntax()),
    };
    let (int, frac) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    if int.is_empty() && frac.is_empty() || frac.contains('.') {
        return Err(syntax());
    }
    let digits = |s: &str| -> Result<u128, QuantityError> {
        if s.is_empty() {
            return Ok(0);
        }
        if s.len() > 30 {
            return Err(range());
        }
        s.parse::<u128>().map_err(|_| syntax())
    };
    let frac_scale = 10u128.checked_pow(frac.len() as u32).ok_or_else(range)?;
    let whole = digits(int)?.checked_mul(mult).ok_or_else(range)?;
    let part = digits(frac)?.checked_mul(mult).ok_or_else(range)?;
    if !part.is_multiple_of(frac_scale) {
        return Err(range());
    }
    let v = whole.checked_add(part / frac_scale).ok_or_else(range)?;
    u64::try_from(v).map_err(|_| range())
}

/// `bytes` as a quantity: the largest binary suffix that divides it exactly.
pub fn format_bytes(bytes: u64) -> String {
    for (suffix, shift) in [
        ("Ei", 60),
        ("Pi", 50),
        ("Ti", 40),
        ("Gi", 30),
        ("Mi", 20),
        ("Ki", 10),
    ] {
        if bytes != 0 && bytes.is_multiple_of(1u64 << shift) {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_exact_values_and_refuses_fractions_and_junk() {
        assert_eq!(parse("30"), Ok(30));
        assert_eq!(parse("20Gi"), Ok(20 << 30));
        assert_eq!(parse("256Mi"), Ok(256 << 20));
        assert_eq!(parse("1.5Gi"), Ok(3 << 29));
        assert_eq!(parse("2G"), Ok(2_000_000_000));
        assert_eq!(parse("1k"), Ok(1000));
        assert!(matches!(parse("0.5"), Err(QuantityError::Range(_))));
        assert!(matches!(parse("100m"), Err(QuantityError::Range(_))));
        assert!(matches!(parse("-1"), Err(QuantityError::Syntax(_))));
        assert!(matches!(parse("20GB"), Err(QuantityError::Syntax(_))));
        assert!(matches!(parse(""), Err(QuantityError::Syntax(_))));
        assert!(matches!(parse("1.2.3"), Err(QuantityError::Syntax(_))));
        assert!(matches!(parse("99999Ei"), Err(QuantityError::Range(_))));
    }

    #[test]
    fn formats_bytes_with_the_largest_exact_suffix() {
        assert_eq!(format_bytes(80 << 30), "80Gi");
        assert_eq!(format_bytes(256 << 20), "256Mi");
        assert_eq!(format_bytes(1000), "1000");
        assert_eq!(format_bytes(0), "0");
        for b in [80u64 << 30, 256 << 20, 12345] {
            assert_eq!(parse(&format_bytes(b)), Ok(b));
        }
    }
}
