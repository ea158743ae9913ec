//! The statuses of orders and holds: enums in Rust, `text` in the tables (whose CHECK
//! constraints list the same words), JSON strings on the wire.

/// An enum stored as a word in a `text` column: serde, `sqlx` encode/decode as that word,
/// `as_str`, `Display` and `FromStr`. (sqlx's derive maps an enum to a Postgres enum *type*;
/// these columns are `text`.)
macro_rules! text_enum {
    ($(#[$meta:meta])* pub enum $name:ident { $($(#[$vmeta:meta])* $variant:ident = $word:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
        pub enum $name {
            $($(#[$vmeta])* #[serde(rename = $word)] $variant,)+
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $word,)+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($word => Ok($name::$variant),)+
                    other => Err(format!("{other:?} is not a {}", stringify!($name))),
                }
            }
        }

        impl sqlx::Type<sqlx::Postgres> for $name {
            fn type_info() -> sqlx::postgres::PgTypeInfo {
                <&str as sqlx::Type<sqlx::Postgres>>::type_info()
            }
            fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
                <&str as sqlx::Type<sqlx::Postgres>>::compatible(ty)
            }
        }

        impl sqlx::Encode<'_, sqlx::Postgres> for $name {
            fn encode_by_ref(
                &self,
                buf: &mut sqlx::postgres::PgArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <&str as sqlx::Encode<sqlx::Postgres>>::encode(self.as_str(), buf)
            }
        }

        impl sqlx::Decode<'_, sqlx::Postgres> for $name {
            fn decode(value: sqlx::postgres::PgValueRef<'_>) -> Result<Self, sqlx::error::BoxDynError> {
                Ok(<&str as sqlx::Decode<sqlx::Postgres>>::decode(value)?.parse()?)
            }
        }
    };
}

text_enum! {
    /// `orders.status`.
    pub enum OrderStatus {
        Confirmed = "confirmed",
        Cancelled = "cancelled",
        /// A refusal's claim on its key: not an order, never served as one.
        Refused = "refused",
    }
}

text_enum! {
    /// `holds.status`.
    pub enum HoldStatus {
        Held = "held",
        /// Its units became the order named by `order_id`.
        Confirmed = "confirmed",
        Released = "released",
        Expired = "expired",
        /// A refusal's claim on its key: not a hold, never served as one.
        Refused = "refused",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_status_reads_back_as_the_word_it_writes() {
        for s in OrderStatus::ALL {
            assert_eq!(s.as_str().parse::<OrderStatus>(), Ok(*s));
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
        for s in HoldStatus::ALL {
            assert_eq!(s.as_str().parse::<HoldStatus>(), Ok(*s));
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
        assert!("shipped".parse::<OrderStatus>().is_err());
    }
}
