//! WAL positions: a byte offset as `pg_lsn - '0/0'` gives it, and PostgreSQL's `16/B374D848`
//! notation. A leaf every layer may use (the router judges freshness with it, the
//! read-your-writes store keeps it, checkout pins a product with it).

/// A WAL position as a byte offset (`pg_lsn` - '0/0'). Under Patroni the top bits carry the
/// timeline (see `routing::patroni`); in the static mode it is the bare offset.
pub type Lsn = u64;

/// Formats a byte offset as PostgreSQL prints an LSN (`16/B374D848`).
pub fn format_lsn(lsn: Lsn) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xffff_ffff)
}

/// Parses `16/B374D848` back into a byte offset.
pub fn parse_lsn(s: &str) -> Option<Lsn> {
    let (hi, lo) = s.split_once('/')?;
    if hi.is_empty() || lo.is_empty() || hi.len() > 8 || lo.len() > 8 {
        return None;
    }
    Some((u64::from_str_radix(hi, 16).ok()? << 32) | u64::from_str_radix(lo, 16).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsns_round_trip_in_postgres_notation() {
        assert_eq!(format_lsn(0x16_B374_D848), "16/B374D848");
        assert_eq!(parse_lsn("16/B374D848"), Some(0x16_B374_D848));
        assert_eq!(parse_lsn("0/0"), Some(0));
        for bad in ["", "/", "1/", "x/1", "123456789/0", "1/2/3"] {
            assert_eq!(parse_lsn(bad), None, "{bad:?}");
        }
    }
}
