//! The file's locations, checked against the database before anything is written: a row
//! naming a location that does not exist is a bad line, like any other.

use super::csv::{BadLine, Row};
use crate::routing::{Db, DbError};
use std::collections::BTreeSet;

/// Moves the rows naming a location that does not exist into `bad` (as `line: unknown
/// location …`, in line order with the others), reading the file's distinct locations from
/// the primary once. A location is never deleted, so one found now is there when the batches
/// write. Returns the rows left.
pub async fn set_aside_unknown_locations(
    db: &Db,
    rows: Vec<Row>,
    bad: &mut Vec<BadLine>,
) -> Result<Vec<Row>, DbError> {
    let named: BTreeSet<&str> = rows.iter().map(|r| r.location_id.as_str()).collect();
    let named: Vec<&str> = named.into_iter().collect();
    let found: Vec<String> =
        sqlx::query_scalar("SELECT location_id FROM locations WHERE location_id = ANY($1)")
            .bind(&named)
            .fetch_all(db.primary().pool()?)
            .await?;
    let (kept, unknown) = split_known(rows, &found);
    if !unknown.is_empty() {
        bad.extend(unknown);
        bad.sort_by_key(|b| b.line);
    }
    Ok(kept)
}

/// The rows at `found` locations, and a bad line for each other one.
fn split_known(rows: Vec<Row>, found: &[String]) -> (Vec<Row>, Vec<BadLine>) {
    let mut unknown = Vec::new();
    let kept = rows
        .into_iter()
        .filter(|r| {
            let known = found.iter().any(|f| f == r.location_id.as_str());
            if !known {
                unknown.push(BadLine {
                    line: r.line,
                    reason: format!(
                        "unknown location {} (create it first: POST /v1/locations)",
                        r.location_id
                    ),
                });
            }
            known
        })
        .collect();
    (kept, unknown)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Mutation: the filter inverted, or the bad line without the row's own line number.
    #[test]
    fn rows_at_unknown_locations_become_bad_lines_naming_line_and_location() {
        let text = b"product_id,name,price_cents,available_quantity,location_id\na,A,1,1,eu-1\nb,B,1,1,nowhere\nc,C,1,1,\n";
        let (rows, bad) = super::super::parse_csv(&text[..]).expect("readable");
        assert!(bad.is_empty(), "{bad:?}");
        let (kept, unknown) = split_known(rows, &["eu-1".into(), "default".into()]);
        let ids: Vec<&str> = kept.iter().map(|r| r.product_id.as_str()).collect();
        assert_eq!(ids, ["a", "c"]);
        assert_eq!(unknown.len(), 1);
        assert_eq!(unknown[0].line, 3);
        assert!(
            unknown[0].reason.contains("unknown location nowhere"),
            "{unknown:?}"
        );
    }
}
