//! Bearer tokens: HS256 JWTs with an issuer, an expiry and a role, signed with
//! `STOCKGATE_TOKEN_SECRET`. Verification (signature in constant time, expiry, issuer) is
//! jsonwebtoken's; this module decides who may act for whom.

use crate::domain::UserId;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use std::time::Duration;

pub const ISSUER: &str = "stockgate";

#[derive(Debug, Serialize, Deserialize)]
struct Claims {
    sub: String,
    role: Role,
    iss: String,
    iat: u64,
    exp: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Role {
    User,
    Admin,
}

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    User(UserId),
    Admin,
}

impl Caller {
    pub fn is_admin(&self) -> bool {
        matches!(self, Caller::Admin)
    }

    /// Whether this caller may act for `user`.
    pub fn may_act_for(&self, user: &UserId) -> bool {
        match self {
            Caller::Admin => true,
            Caller::User(me) => me == user,
        }
    }
}

/// Signs and verifies tokens. The secret never leaves this struct (and `Debug` hides it).
#[derive(Clone)]
pub struct Tokens {
    encoding: EncodingKey,
    decoding: DecodingKey,
    validation: Validation,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tokens(<secret>)")
    }
}

#[derive(Debug, thiserror::Error)]
#[error("invalid token")]
pub struct InvalidToken;

impl Tokens {
    pub fn new(secret: &str) -> Self {
        let mut validation = Validation::new(Algorithm::HS256);
        validation.set_issuer(&[ISSUER]);
        validation.set_required_spec_claims(&["exp", "iss", "sub"]);
        validation.leeway = 5;
        Tokens {
            encoding: EncodingKey::from_secret(secret.as_bytes()),
            decoding: DecodingKey::from_secret(secret.as_bytes()),
            validation,
        }
    }

    pub fn issue(&self, caller: &Caller, ttl: Duration) -> anyhow::Result<String> {
        let now = jsonwebtoken::get_current_timestamp();
        let (sub, role) = match caller {
            Caller::User(u) => (u.to_string(), Role::User),
            Caller::Admin => ("admin".to_string(), Role::Admin),
        };
        let claims = Claims {
            sub,
            role,
            iss: ISSUER.into(),
            iat: now,
            exp: now + ttl.as_secs(),
        };
        Ok(jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &self.encoding,
        )?)
    }

    /// Issues a token that expired `ago` ago (for tests of expiry).
    pub fn issue_expired(&self, caller: &Caller, ago: Duration) -> anyhow::Result<String> {
        let now = jsonwebtoken::get_current_timestamp();
        let sub = match caller {
            Caller::User(u) => u.to_string(),
            Caller::Admin => "admin".into(),
        };
        let role = if caller.is_admin() {
            Role::Admin
        } else {
            Role::User
        };
        let claims = Claims {
            sub,
            role,
            iss: ISSUER.into(),
            iat: now - ago.as_secs() - 60,
            exp: now - ago.as_secs(),
        };
        Ok(jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &self.encoding,
        )?)
    }

    pub fn verify(&self, token: &str) -> Result<Caller, InvalidToken> {
        let data = jsonwebtoken::decode::<Claims>(token, &self.decoding, &self.validation)
            .map_err(|_| InvalidToken)?;
        match data.claims.role {
            Role::Admin => Ok(Caller::Admin),
            Role::User => UserId::parse(&data.claims.sub)
                .map(Caller::User)
                .map_err(|_| InvalidToken),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    fn ada() -> Caller {
        Caller::User(UserId::parse("ada").expect("valid"))
    }

    #[test]
    fn tokens_round_trip_with_their_role() {
        let t = Tokens::new("0123456789abcdef-secret");
        assert_eq!(
            t.verify(&t.issue(&ada(), DAY).expect("signs")).ok(),
            Some(ada())
        );
        assert_eq!(
            t.verify(&t.issue(&Caller::Admin, DAY).expect("signs")).ok(),
            Some(Caller::Admin)
        );
    }

    #[test]
    fn foreign_tampered_and_expired_tokens_are_refused() {
        let t = Tokens::new("0123456789abcdef-secret");
        let other = Tokens::new("another-secret-of-16-bytes");
        assert!(
            t.verify(&other.issue(&Caller::Admin, DAY).expect("signs"))
                .is_err()
        );
        let good = t.issue(&ada(), DAY).expect("signs");
        let mut tampered = good.clone().into_bytes();
        let mid = tampered.len() / 2;
        tampered[mid] = if tampered[mid] == b'A' { b'B' } else { b'A' };
        assert!(
            t.verify(&String::from_utf8(tampered).expect("ascii"))
                .is_err()
        );
        assert!(
            t.verify(
                &t.issue_expired(&ada(), Duration::from_secs(120))
                    .expect("signs")
            )
            .is_err()
        );
        assert!(t.verify("not.a.token").is_err());
    }

    #[test]
    fn users_act_only_for_themselves() {
        let me = UserId::parse("ada").expect("valid");
        let you = UserId::parse("bob").expect("valid");
        assert!(ada().may_act_for(&me));
        assert!(!ada().may_act_for(&you));
        assert!(Caller::Admin.may_act_for(&you));
    }
}
