//! Sizes in bytes, as people write and read them: one parser for every flag and spec
//! (`tessera run --memory`, `tessera sim --gpus`, `TESSERA_SIM_GPUS`) and one formatter for
//! messages (the arbiter's refusals).

/// Errors of size parsing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// Nothing given.
    #[error("empty size: expected e.g. 512MiB, 4GiB or 1.5G")]
    Empty,
    /// A number without a unit: `--memory 4` meant 4 GiB far more often than 4 bytes, so a
    /// bare number is refused rather than read as bytes (`4B` says bytes).
    #[error("{0}: a size needs a unit, e.g. {0}GiB ({0}B for bytes)")]
    NoUnit(String),
    /// The number part is not a number.
    #[error(
        "{0:?} is not a size: expected a number then a unit (B, KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, GB, TB)"
    )]
    Number(String),
    /// Unknown unit.
    #[error(
        "unknown unit {unit:?} in {text:?}: use B, KiB, MiB, GiB, TiB (or K, M, G, T, also 1024-based) or KB, MB, GB, TB (1000-based)"
    )]
    Unit {
        /// The whole input.
        text: String,
        /// The unit part.
        unit: String,
    },
    /// Zero bytes.
    #[error("{0:?} is zero bytes")]
    Zero(String),
    /// Fractional bytes.
    #[error("{0:?} is not a whole number of bytes")]
    Fraction(String),
    /// Too big.
    #[error("{0:?} is too large")]
    TooLarge(String),
}

/// Parses a size: a number (fractions allowed) and a unit.
/// `K`, `M`, `G`, `T` and `KiB`..`TiB` (also `Ki`..`Ti`) are powers of 1024, as GPU memory
/// is counted; `KB`, `MB`, `GB`, `TB` are powers of 1000; `B` is bytes. A number without a
/// unit is refused ([`SizeError::NoUnit`]), except `0`, which is zero in every unit (and then
/// refused as [`SizeError::Zero`] here: callers that take 0 use [`parse_size_or_zero`]).
/// Units are case-insensitive and may follow a space.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(SizeError::Empty);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim();
    if unit.is_empty() {
        // `num` is all digits and dots here (the unit starts at the first other character).
        let number = num.chars().any(|c| c.is_ascii_digit()) && num.matches('.').count() <= 1;
        return Err(if !number {
            SizeError::Number(text.into())
        } else if num.chars().all(|c| c == '0' || c == '.') {
            SizeError::Zero(text.into())
        } else {
            SizeError::NoUnit(t.into())
        });
    }
    let mult: u128 = match unit.to_ascii_lowercase().as_str() {
        "b" => 1,
        "k" | "ki" | "kib" => 1 << 10,
        "m" | "mi" | "mib" => 1 << 20,
        "g" | "gi" | "gib" => 1 << 30,
        "t" | "ti" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => {
            return Err(SizeError::Unit {
                text: text.into(),
                unit: unit.into(),
            });
        }
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    let digits_ok = |s: &str| s.chars().all(|c| c.is_ascii_digit());
    if (int.is_empty() && frac.is_empty()) || !digits_ok(int) || !digits_ok(frac) {
        return Err(SizeError::Number(text.into()));
    }
    if frac.len() > 18 || int.len() > 20 {
        return Err(SizeError::TooLarge(text.into()));
    }
    let int_v: u128 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| SizeError::TooLarge(text.into()))?
    };
    let frac_v: u128 = if frac.is_empty() {
        0
    } else {
        frac.parse().expect("digits")
    };
    let scale = 10u128.pow(frac.len() as u32);
    let frac_bytes = frac_v * mult;
    if !frac_bytes.is_multiple_of(scale) {
        return Err(SizeError::Fraction(text.into()));
    }
    let bytes = int_v
        .checked_mul(mult)
        .and_then(|b| b.checked_add(frac_bytes / scale))
        .filter(|b| *b <= u128::from(u64::MAX))
        .ok_or_else(|| SizeError::TooLarge(text.into()))?;
    if bytes == 0 {
        return Err(SizeError::Zero(text.into()));
    }
    Ok(bytes as u64)
}

/// [`parse_size`], with `0` (any unit, or none) read as zero bytes: for settings where 0
/// means "none" (a simulated context's memory, a quota of nothing).
pub fn parse_size_or_zero(text: &str) -> Result<u64, SizeError> {
    match parse_size(text) {
        Err(SizeError::Zero(_)) => Ok(0),
        other => other,
    }
}

/// Bytes for people: exact when whole (`80 GiB`, `512 MiB`, `7 B`), else two decimals
/// (`1.50 GiB`) in the largest binary unit that fits.
pub fn human(bytes: u64) -> String {
    format_bytes(bytes, true)
}

/// Bytes for a table column: always two decimals (`80.00 GiB`, `7.29 GiB`), so a column of
/// them lines up; the same units as [`human`].
pub fn human_fixed(bytes: u64) -> String {
    format_bytes(bytes, false)
}

fn format_bytes(bytes: u64, whole_exact: bool) -> String {
    const UNITS: [(&str, u64); 5] = [
        ("PiB", 1 << 50),
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (unit, size) in UNITS {
        if bytes >= size {
            return if whole_exact && bytes.is_multiple_of(size) {
                format!("{} {unit}", bytes / size)
            } else {
                format!("{:.2} {unit}", bytes as f64 / size as f64)
            };
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_sizes_line_up() {
        assert_eq!(human_fixed(80 << 30), "80.00 GiB");
        assert_eq!(human_fixed((7 << 30) + (300 << 20)), "7.29 GiB");
        assert_eq!(human_fixed(512), "512 B");
        assert_eq!(human(80 << 30), "80 GiB");
    }

    #[test]
    fn sizes_in_every_documented_form() {
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("4G"), Ok(4 << 30));
        assert_eq!(parse_size("4g"), Ok(4 << 30));
        assert_eq!(parse_size("4Gi"), Ok(4 << 30));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size(" 2 GiB "), Ok(2 << 30));
        assert_eq!(parse_size("4GB"), Ok(4_000_000_000));
        assert_eq!(parse_size("100MB"), Ok(100_000_000));
        assert_eq!(parse_size("1048576B"), Ok(1 << 20));
        assert_eq!(parse_size("7B"), Ok(7));
        assert_eq!(parse_size(".5KiB"), Ok(512));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
    }

    #[test]
    fn bad_sizes_are_clear_errors() {
        assert_eq!(parse_size(""), Err(SizeError::Empty));
        assert!(matches!(parse_size("4XB"), Err(SizeError::Unit { unit, .. }) if unit == "XB"));
        assert!(matches!(parse_size("abc"), Err(SizeError::Unit { .. })));
        assert!(matches!(parse_size("GiB"), Err(SizeError::Number(_))));
        assert!(matches!(parse_size("1.2.3GiB"), Err(SizeError::Number(_))));
        assert!(matches!(parse_size("-4GiB"), Err(SizeError::Unit { .. })));
        assert!(matches!(parse_size("0"), Err(SizeError::Zero(_))));
        assert!(matches!(parse_size("0GiB"), Err(SizeError::Zero(_))));
        assert_eq!(parse_size_or_zero("0"), Ok(0));
        assert_eq!(parse_size_or_zero("0MiB"), Ok(0));
        assert_eq!(parse_size_or_zero("3MiB"), Ok(3 << 20));
        assert!(matches!(parse_size("1.5B"), Err(SizeError::Fraction(_))));
        assert!(matches!(
            parse_size("99999999999TiB"),
            Err(SizeError::TooLarge(_))
        ));
        assert!(matches!(
            parse_size("18446744073709551616B"),
            Err(SizeError::TooLarge(_))
        ));
        let msg = parse_size("4XB").unwrap_err().to_string();
        assert!(msg.contains("GiB") && msg.contains("\"XB\""), "{msg}");
    }

    /// `--memory 4` and `--gpus 2x80` made 4-byte and 80-byte things: a bare number is refused,
    /// with the spelling that was probably meant.
    #[test]
    fn a_number_without_a_unit_is_refused() {
        assert_eq!(parse_size("4"), Err(SizeError::NoUnit("4".into())));
        assert_eq!(parse_size(" 80 "), Err(SizeError::NoUnit("80".into())));
        assert_eq!(parse_size("1.5"), Err(SizeError::NoUnit("1.5".into())));
        assert_eq!(
            parse_size("4").unwrap_err().to_string(),
            "4: a size needs a unit, e.g. 4GiB (4B for bytes)"
        );
        assert!(matches!(parse_size("1e9"), Err(SizeError::Unit { .. })));
    }

    #[test]
    fn human_sizes_are_exact_when_whole() {
        assert_eq!(human(80 << 30), "80 GiB");
        assert_eq!(human(100 << 40), "100 TiB");
        assert_eq!(human(3 << 29), "1.50 GiB");
        assert_eq!(human(512), "512 B");
        assert_eq!(human(4_000_000_000), "3.73 GiB");
        // What human() prints, parse_size() reads back (whole values exactly).
        for b in [7u64, 512 << 20, 80 << 30, 100 << 40] {
            assert_eq!(parse_size(&human(b)), Ok(b));
        }
    }
}
