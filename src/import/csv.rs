//! Reading an import's CSV: the header in any column order, every line validated, every bad
//! line named with its number.

use crate::domain::{ProductId, ProductName};
use serde::Serialize;
use std::collections::HashSet;

/// One valid CSV row.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub product_id: ProductId,
    pub name: String,
    pub price_cents: i32,
    /// The count the file states for the product (the CSV's `available_quantity`).
    pub available_quantity: i32,
}

/// A line that could not be imported.
#[derive(Debug, Clone, Serialize, PartialEq, utoipa::ToSchema)]
pub struct BadLine {
    pub line: u64,
    pub reason: String,
}

/// The most a single line may be (a 10 MB line is refused, not buffered into a batch).
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// Parses and validates a whole CSV. Returns the valid rows and every bad line; an error
/// that makes the file unreadable as a whole (no header, missing columns) is `Err`.
pub fn parse_csv(input: impl std::io::Read) -> Result<(Vec<Row>, Vec<BadLine>), String> {
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(true)
        .flexible(true)
        .from_reader(input);
    let headers = reader
        .byte_headers()
        .map_err(|e| format!("cannot read the header line: {e}"))?
        .clone();
    let column = |name: &str| {
        headers
            .iter()
            .position(|h| h.trim_ascii() == name.as_bytes())
    };
    let cols = ["product_id", "name", "price_cents", "available_quantity"].map(|c| (c, column(c)));
    let missing: Vec<&str> = cols
        .iter()
        .filter(|(_, i)| i.is_none())
        .map(|(c, _)| *c)
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "line 1: the header is missing {} (expected product_id,name,price_cents,available_quantity)",
            missing.join(", ")
        ));
    }
    let idx: Vec<usize> = cols.iter().filter_map(|(_, i)| *i).collect();
    let mut rows = Vec::new();
    let mut bad = Vec::new();
    let mut seen: HashSet<ProductId> = HashSet::new();
    let mut record = csv::ByteRecord::new();
    loop {
        let line = reader.position().line();
        match reader.read_byte_record(&mut record) {
            Ok(false) => break,
            Ok(true) => {}
            Err(e) => {
                // A broken record (e.g. an unterminated quote) ends the readable part of the file.
                bad.push(BadLine {
                    line: e.position().map(|p| p.line()).unwrap_or(line),
                    reason: format!("unreadable CSV: {e}"),
                });
                break;
            }
        }
        let line = record.position().map(|p| p.line()).unwrap_or(line);
        match parse_row(&record, &idx) {
            Ok(row) if !seen.insert(row.product_id.clone()) => bad.push(BadLine {
                line,
                reason: format!(
                    "duplicate product_id {} (already on an earlier line)",
                    row.product_id
                ),
            }),
            Ok(row) => rows.push(row),
            Err(reason) => bad.push(BadLine { line, reason }),
        }
    }
    Ok((rows, bad))
}

fn parse_row(record: &csv::ByteRecord, idx: &[usize]) -> Result<Row, String> {
    if record.as_slice().len() > MAX_LINE_BYTES {
        return Err(format!(
            "line is {} bytes, over the {MAX_LINE_BYTES}-byte limit",
            record.as_slice().len()
        ));
    }
    let field = |k: usize, name: &str| -> Result<&str, String> {
        let raw = record
            .get(idx[k])
            .ok_or_else(|| format!("missing {name}"))?;
        std::str::from_utf8(raw)
            .map(str::trim)
            .map_err(|_| format!("{name} is not valid UTF-8"))
    };
    let number = |k: usize, name: &str| -> Result<i32, String> {
        let v = field(k, name)?;
        match v.parse::<i64>() {
            Ok(n) if (0..=i32::MAX as i64).contains(&n) => Ok(n as i32),
            Ok(n) => Err(format!("{name} {n} is out of range (0..2147483647)")),
            Err(_) => Err(format!("{name} {v:?} is not a whole number")),
        }
    };
    let id = ProductId::parse(field(0, "product_id")?).map_err(|e| e.message)?;
    let name = ProductName::parse(field(1, "name")?).map_err(|e| e.message)?;
    Ok(Row {
        product_id: id,
        name: name.as_str().to_string(),
        price_cents: number(2, "price_cents")?,
        available_quantity: number(3, "available_quantity")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &[u8]) -> (Vec<Row>, Vec<BadLine>) {
        parse_csv(text).expect("readable file")
    }

    #[test]
    fn a_good_file_parses_in_any_column_order() {
        let (rows, bad) = parse(b"name,product_id,available_quantity,price_cents\nMug,mug-1,5,1299\n\"Tee, black\",tee,0,2499\n");
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(
            rows[1],
            Row {
                product_id: ProductId::parse("tee").expect("valid id"),
                name: "Tee, black".into(),
                price_cents: 2499,
                available_quantity: 0
            }
        );
    }

    #[test]
    fn bad_lines_are_reported_with_their_line_numbers() {
        let mut text = b"product_id,name,price_cents,available_quantity\nok,Fine,1,1\nneg,Negative,1,-5\nnum,Bad number,abc,1\nok,Again,1,1\nbad id!,Name,1,1\n".to_vec();
        text.extend_from_slice(b"latin,\xe9t\xe9,1,1\n");
        text.extend_from_slice(format!("huge,{},1,1\n", "x".repeat(10 * 1024 * 1024)).as_bytes());
        let (rows, bad) = parse(&text);
        assert_eq!(rows.len(), 1);
        let lines: Vec<u64> = bad.iter().map(|b| b.line).collect();
        assert_eq!(lines, vec![3, 4, 5, 6, 7, 8], "{bad:?}");
        assert!(bad[0].reason.contains("out of range"), "{}", bad[0].reason);
        assert!(bad[1].reason.contains("not a whole number"));
        assert!(bad[2].reason.contains("duplicate"));
        assert!(bad[4].reason.contains("UTF-8"));
        assert!(bad[5].reason.contains("limit"));
    }

    #[test]
    fn a_missing_column_refuses_the_whole_file() {
        let err =
            parse_csv(&b"product_id,name,price_cents\nx,y,1\n"[..]).expect_err("missing column");
        assert!(
            err.contains("line 1") && err.contains("available_quantity"),
            "{err}"
        );
    }
}
