//! Bearer tokens: HS256 JWTs with an issuer, an expiry and a role, signed with
//! `STOCKGATE_TOKEN_SECRET`. Verification (signature in constant time, expiry, issuer) is
//! jsonwebtoken's; this module decides who may act for whom.
//!
//! A token that verified is remembered (by its whole text, signature included) until its
//! expiry, so a client's next request skips the decode: under the hot-SKU load the decode
//! (base64, two JSON parses, a clone of the validation rules, the HMAC) showed in an order's
//! profile (`bench/results/`). A cached token is only ever the exact string that verified, and it stops
//! being accepted at the same instant the full check would start refusing it.

use crate::domain::UserId;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
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

    /// Whether this caller may act for, or see what belongs to, the user `user_id`.
    pub fn may_act_for(&self, user_id: &str) -> bool {
        match self {
            Caller::Admin => true,
            Caller::User(me) => me.as_str() == user_id,
        }
    }
}

/// Signs and verifies tokens. The secret never leaves this struct (and `Debug` hides it).
#[derive(Clone)]
pub struct Tokens {
    encoding: EncodingKey,
    decoding: DecodingKey,
    validation: Validation,
    verified: Arc<Mutex<HashMap<Box<str>, Verified>>>,
}

/// A token that passed the full check, and the last second (Unix time) it may be used.
#[derive(Clone)]
struct Verified {
    caller: Caller,
    until: u64,
}

/// Most remembered tokens; past this the memory is dropped and refills from new requests.
const REMEMBERED: usize = 100_000;

/// Seconds after `exp` that a token is still accepted (clock skew between issuer and us).
const LEEWAY: u64 = 5;

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
        validation.leeway = LEEWAY;
        Tokens {
            encoding: EncodingKey::from_secret(secret.as_bytes()),
            decoding: DecodingKey::from_secret(secret.as_bytes()),
            validation,
            verified: Arc::default(),
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
        self.verify_at(token, jsonwebtoken::get_current_timestamp())
    }

    /// [`Tokens::verify`] at `now` (Unix seconds): the remembered answer while `now` is
    /// within the token's lifetime, else the full check.
    fn verify_at(&self, token: &str, now: u64) -> Result<Caller, InvalidToken> {
        let mut verified = self.verified.lock().unwrap_or_else(|p| p.into_inner());
        match verified.get(token) {
            Some(v) if now <= v.until => return Ok(v.caller.clone()),
            Some(_) => {
                verified.remove(token);
            }
            None => {}
        }
        drop(verified);
        let data = jsonwebtoken::decode::<Claims>(token, &self.decoding, &self.validation)
            .map_err(|_| InvalidToken)?;
        let caller = match data.claims.role {
            Role::Admin => Caller::Admin,
            Role::User => UserId::parse(&data.claims.sub)
                .map(Caller::User)
                .map_err(|_| InvalidToken)?,
        };
        let until = data.claims.exp.saturating_add(LEEWAY);
        // jsonwebtoken judged expiry by its own reading of the clock; ours must agree.
        if now > until {
            return Err(InvalidToken);
        }
        {
            let mut verified = self.verified.lock().unwrap_or_else(|p| p.into_inner());
            if verified.len() >= REMEMBERED {
                verified.clear();
            }
            verified.insert(
                token.into(),
                Verified {
                    caller: caller.clone(),
                    until,
                },
            );
        }
        Ok(caller)
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
    fn a_remembered_token_expires_when_the_full_check_would_refuse_it() {
        let t = Tokens::new("0123456789abcdef-secret");
        let now = jsonwebtoken::get_current_timestamp();
        let token = t.issue(&ada(), Duration::from_secs(60)).expect("signs");
        assert_eq!(t.verify_at(&token, now).ok(), Some(ada()));
        assert_eq!(
            t.verified.lock().expect("lock").len(),
            1,
            "it is remembered"
        );
        assert_eq!(
            t.verify_at(&token, now + 60 + LEEWAY).ok(),
            Some(ada()),
            "up to expiry plus the leeway"
        );
        assert!(
            t.verify_at(&token, now + 60 + LEEWAY + 1).is_err(),
            "one second past it, the remembered answer is not used"
        );
        assert!(
            t.verified.lock().expect("lock").is_empty(),
            "and is dropped"
        );
        // A token that never verified is never remembered, even one differing by a byte.
        let mut forged = token.into_bytes();
        let last = forged.len() - 1;
        forged[last] = if forged[last] == b'A' { b'B' } else { b'A' };
        let forged = String::from_utf8(forged).expect("ascii");
        assert!(t.verify_at(&forged, now).is_err());
        assert!(t.verified.lock().expect("lock").is_empty());
    }

    #[test]
    fn users_act_only_for_themselves() {
        let me = UserId::parse("ada").expect("valid");
        let you = UserId::parse("bob").expect("valid");
        assert!(ada().may_act_for(me.as_str()));
        assert!(!ada().may_act_for(you.as_str()));
        assert!(Caller::Admin.may_act_for(you.as_str()));
    }
}
