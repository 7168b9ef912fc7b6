//! Byte sizes as people write them: `--max-memory 4GiB` parsed, byte counts printed
//! (`1.50 KiB`). Depends on nothing, so the error type can print a size too.

/// Parses a size: a number (fractions allowed) and a unit. Binary units (`B`, `KiB`, `MiB`,
/// `GiB`, `TiB`, and the short `K`, `M`, `G`, `T` that `free -g`, Docker and Slurm read as
/// binary too), decimal ones (`KB`, `MB`, `GB`, `TB`), case-insensitive; a bare number is
/// bytes. `4GiB`, `512MiB`, `1.5G`, `64gb`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a size (e.g. 4GiB, 512MiB)"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => {
            return Err(format!(
                "`{text}`: unknown unit `{other}` (B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB)"
            ));
        }
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("`{text}` is too large"));
    }
    Ok(bytes.round() as u64)
}

/// `1536` -> `1.5 KiB`; three significant digits, binary units.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    let digits = if value >= 100.0 {
        0
    } else if value >= 10.0 {
        1
    } else {
        2
    };
    format!("{value:.digits$} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_binary_and_decimal_units() {
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5g"), Ok(3 << 29));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert_eq!(parse_size("8 KiB"), Ok(8192));
        assert!(parse_size("GiB").is_err());
        assert!(
            parse_size("4 parsecs")
                .unwrap_err()
                .contains("unknown unit")
        );
        assert!(parse_size("-4GiB").is_err());
        assert!(parse_size("1e30TiB").is_err());
    }

    #[test]
    fn bytes_format_with_three_digits() {
        assert_eq!(format_bytes(100), "100 B");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(4 << 30), "4.00 GiB");
        assert_eq!(format_bytes(300 << 20), "300 MiB");
    }
}
