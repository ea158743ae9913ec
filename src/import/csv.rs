//! Reading an import's CSV: the header in any column order, every line validated, every bad
//! line named with its number.
//!
//! A line states one product's count at one location: the optional `location_id` column
//! names it (absent or empty: `default`). So a product may have a line per location, each
//! (product, location) once. Its name and price are the product's, so every line of a
//! product must give the same ones: a line that differs from the product's first is bad
//! (taking the first silently would hide a typo in a file that renames a product).

use crate::domain::{LocationId, ProductId, ProductName};
use serde::Serialize;
use std::collections::HashMap;

/// The location a line that names none states its count at.
pub const DEFAULT_LOCATION: &str = "default";

/// One valid CSV row.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The file's line number, for messages about this row.
    pub line: u64,
    pub product_id: ProductId,
    /// Where the count is stated (the CSV's optional `location_id`; `default` without it).
    pub location_id: LocationId,
    pub name: String,
    pub price_cents: i32,
    /// The count the file states for the product at the location (the CSV's
    /// `available_quantity`).
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

/// The columns every file has, in the order [`parse_row`] reads them.
const REQUIRED: [&str; 4] = ["product_id", "name", "price_cents", "available_quantity"];

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
    let cols = REQUIRED.map(|c| (c, column(c)));
    let missing: Vec<&str> = cols
        .iter()
        .filter(|(_, i)| i.is_none())
        .map(|(c, _)| *c)
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "line 1: the header is missing {} (expected product_id,name,price_cents,available_quantity and optionally location_id)",
            missing.join(", ")
        ));
    }
    let idx = Columns {
        required: cols.map(|(_, i)| i.unwrap_or_default()),
        location: column("location_id"),
    };
    let mut rows = Vec::new();
    let mut bad = Vec::new();
    let mut seen = Seen::default();
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
        match parse_row(&record, &idx, line).and_then(|row| seen.admit(row)) {
            Ok(row) => rows.push(row),
            Err(reason) => bad.push(BadLine { line, reason }),
        }
    }
    Ok((rows, bad))
}

/// Where each column is: the required ones in [`REQUIRED`]'s order, and `location_id`'s if the
/// header has it.
struct Columns {
    required: [usize; 4],
    location: Option<usize>,
}

/// What the earlier lines stated: each (product, location) once, and each product's name
/// and price with the line that first gave them.
#[derive(Default)]
struct Seen {
    levels: HashMap<(ProductId, LocationId), u64>,
    products: HashMap<ProductId, (String, i32, u64)>,
}

impl Seen {
    /// The row, if it repeats no (product, location) and agrees with its product's first line.
    fn admit(&mut self, row: Row) -> Result<Row, String> {
        let level = (row.product_id.clone(), row.location_id.clone());
        if let Some(first) = self.levels.get(&level) {
            return Err(format!(
                "duplicate product_id {} at location {} (already on line {first})",
                row.product_id, row.location_id
            ));
        }
        if let Some((name, price, first)) = self.products.get(&row.product_id)
            && (name != &row.name || *price != row.price_cents)
        {
            return Err(format!(
                "product_id {} has another name or price than on line {first} (a product's lines must agree)",
                row.product_id
            ));
        }
        self.levels.insert(level, row.line);
        self.products
            .entry(row.product_id.clone())
            .or_insert_with(|| (row.name.clone(), row.price_cents, row.line));
        Ok(row)
    }
}

fn parse_row(record: &csv::ByteRecord, idx: &Columns, line: u64) -> Result<Row, String> {
    if record.as_slice().len() > MAX_LINE_BYTES {
        return Err(format!(
            "line is {} bytes, over the {MAX_LINE_BYTES}-byte limit",
            record.as_slice().len()
        ));
    }
    let text = |at: usize, name: &str| -> Result<&str, String> {
        let raw = record.get(at).ok_or_else(|| format!("missing {name}"))?;
        std::str::from_utf8(raw)
            .map(str::trim)
            .map_err(|_| format!("{name} is not valid UTF-8"))
    };
    let field = |k: usize, name: &str| text(idx.required[k], name);
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
    let location = match idx.location {
        Some(at) => text(at, "location_id")?,
        None => "",
    };
    let location = match location {
        "" => DEFAULT_LOCATION,
        given => given,
    };
    Ok(Row {
        line,
        product_id: id,
        location_id: LocationId::parse(location).map_err(|e| e.message)?,
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
                line: 3,
                product_id: ProductId::parse("tee").expect("valid id"),
                location_id: LocationId::parse("default").expect("valid id"),
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

    fn levels(rows: &[Row]) -> Vec<(&str, &str, i32, u64)> {
        rows.iter()
            .map(|r| {
                let (p, l) = (r.product_id.as_str(), r.location_id.as_str());
                (p, l, r.available_quantity, r.line)
            })
            .collect()
    }

    // Mutations: `location_id` read from another column, or an empty cell refused instead of
    // meaning `default`.
    #[test]
    fn a_location_id_column_states_each_products_count_at_that_location() {
        let (rows, bad) = parse(
            b"product_id,location_id,name,price_cents,available_quantity\n\
              mug,eu-1,Mug,100,5\nmug,us.2,Mug,100,7\nmug,,Mug,100,1\ntee, eu-1 ,Tee,200,0\n",
        );
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(
            levels(&rows),
            [
                ("mug", "eu-1", 5, 2),
                ("mug", "us.2", 7, 3),
                ("mug", "default", 1, 4),
                ("tee", "eu-1", 0, 5)
            ]
        );
    }

    // Mutation: the duplicate check keyed on the product alone (then a product at two
    // locations is refused) or on the location alone.
    #[test]
    fn the_same_product_at_the_same_location_twice_is_a_bad_line_naming_the_first() {
        let (rows, bad) = parse(
            b"product_id,name,price_cents,available_quantity,location_id\n\
              a,A,1,1,eu-1\nb,B,1,1,eu-1\na,A,1,2,default\na,A,1,3,eu-1\na,A,1,4,\n",
        );
        assert_eq!(rows.len(), 3, "{rows:?}");
        let lines: Vec<(u64, &str)> = bad.iter().map(|b| (b.line, b.reason.as_str())).collect();
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0].0, 5);
        assert!(
            lines[0].1.contains("duplicate")
                && lines[0].1.contains("eu-1")
                && lines[0].1.contains("line 2"),
            "{lines:?}"
        );
        // An empty cell is `default`: the same level as line 4's.
        assert_eq!(lines[1].0, 6);
        assert!(
            lines[1].1.contains("default") && lines[1].1.contains("line 4"),
            "{lines:?}"
        );
    }

    // Mutation: the name and price taken from whichever line comes first without a check
    // (the renaming line is then imported).
    #[test]
    fn a_product_whose_lines_disagree_on_name_or_price_is_a_bad_line() {
        let (rows, bad) = parse(
            b"product_id,name,price_cents,available_quantity,location_id\n\
              a,A,1,1,eu-1\na,Other,1,1,eu-2\na,A,9,1,eu-3\na,A,1,1,eu-4\n",
        );
        assert_eq!(levels(&rows), [("a", "eu-1", 1, 2), ("a", "eu-4", 1, 5)]);
        let lines: Vec<u64> = bad.iter().map(|b| b.line).collect();
        assert_eq!(lines, [3, 4], "{bad:?}");
        assert!(bad[0].reason.contains("line 2"), "{}", bad[0].reason);
    }

    // Mutation: location ids not parsed as `LocationId` (a bad one reaches the database).
    #[test]
    fn a_bad_location_id_is_a_bad_line() {
        let (rows, bad) = parse(
            b"product_id,name,price_cents,available_quantity,location_id\n\
              a,A,1,1,eu 1\nb,B,1,1,\xe9\nc,C,1,1,eu-1\nd,D,1,1\n",
        );
        assert_eq!(levels(&rows), [("c", "eu-1", 1, 4)]);
        let reasons: Vec<(u64, &str)> = bad.iter().map(|b| (b.line, b.reason.as_str())).collect();
        assert_eq!(reasons.len(), 3, "{reasons:?}");
        assert!(reasons[0].1.contains("location_id"), "{reasons:?}");
        assert!(reasons[1].1.contains("UTF-8"), "{reasons:?}");
        // A line too short to have the column is not taken for `default`.
        assert!(reasons[2].1.contains("missing location_id"), "{reasons:?}");
    }
}
