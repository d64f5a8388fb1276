//! Broker credentials encrypted at rest (docs/operating.md, Broker credentials).
//!
//! `trading_accounts.credentials` holds `enc:v1:<base64 of nonce ‖ ciphertext ‖ tag>`:
//! ChaCha20-Poly1305 with a 32-byte key and a random 96-bit nonce per value. The key comes from
//! the node's environment (`COPIER_CREDENTIALS_KEY`) or a secrets file (`credentials_key_file`);
//! `copier-node credentials keygen` makes one and `copier-node credentials encrypt` turns a
//! password into a column value. A value is decrypted only in the account session that logs in,
//! and neither the key, the value nor the password ever reaches a log line, a metric, `status`
//! or an error message: errors say what is wrong, never what the value was.

use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};

use crate::secret::Secret;

/// What every encrypted value starts with (the format's version: a new format gets a new tag).
pub const PREFIX: &str = "enc:v1:";
const NONCE_LEN: usize = 12;

/// The node's credentials key: one key, or during a rotation the new key first and the old ones
/// after it (`new,old`). New values are encrypted with the first; a value decrypts with any.
/// `Debug` never shows them.
#[derive(Clone, PartialEq, Eq)]
pub struct CredentialsKey(Vec<[u8; 32]>);

impl fmt::Debug for CredentialsKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CredentialsKey(<{} redacted>)", self.0.len())
    }
}

impl CredentialsKey {
    /// A new random key.
    pub fn generate() -> Self {
        CredentialsKey(vec![ChaCha20Poly1305::generate_key(&mut OsRng).into()])
    }

    /// Parses keys written as base64, separated by commas or whitespace (so a file's final
    /// newline is ignored). The error describes the problem without repeating a value.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut keys = Vec::new();
        for (n, part) in text
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|p| !p.is_empty())
            .enumerate()
        {
            let which = if n == 0 {
                "the key".to_string()
            } else {
                format!("key {} of the list", n + 1)
            };
            let bytes = STANDARD.decode(part).map_err(|_| {
                format!("expected 32 bytes in base64 (make one with `copier-node credentials keygen`); {which} is not base64")
            })?;
            let key: [u8; 32] = bytes.as_slice().try_into().map_err(|_| {
                format!(
                    "expected 32 bytes in base64 (make one with `copier-node credentials keygen`); {which} decodes to {} bytes",
                    bytes.len()
                )
            })?;
            keys.push(key);
        }
        if keys.is_empty() {
            return Err("expected a key (base64 of 32 bytes), got nothing".into());
        }
        Ok(CredentialsKey(keys))
    }

    /// The keys as base64, the current one first, comma-separated (one key for `keygen`).
    pub fn encode(&self) -> String {
        self.0
            .iter()
            .map(|k| STANDARD.encode(k))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// These keys with `older` ones after them (a rotation: new values use the first).
    pub fn then(mut self, older: &CredentialsKey) -> Self {
        self.0.extend_from_slice(&older.0);
        self
    }

    /// The first key alone: the one new values are encrypted with.
    fn current(&self) -> CredentialsKey {
        CredentialsKey(vec![self.0[0]])
    }

    fn cipher(key: &[u8; 32]) -> ChaCha20Poly1305 {
        ChaCha20Poly1305::new(Key::from_slice(key))
    }

    /// Encrypts a password into a `credentials` column value, with the current key.
    pub fn encrypt(&self, plaintext: &str) -> String {
        let nonce = ChaCha20Poly1305::generate_nonce(&mut OsRng);
        let sealed = Self::cipher(&self.0[0])
            .encrypt(&nonce, plaintext.as_bytes())
            .expect("ChaCha20-Poly1305 encrypts any input that fits in memory");
        let mut raw = nonce.to_vec();
        raw.extend_from_slice(&sealed);
        format!("{PREFIX}{}", STANDARD.encode(raw))
    }
}

/// Why a stored value cannot be used to log in. The messages name the problem and the fix, and
/// never the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CredentialsError {
    #[error(
        "the account has credentials but this node has no credentials key to decrypt them (set COPIER_CREDENTIALS_KEY or credentials_key_file and restart the node)"
    )]
    NoKey,
    #[error(
        "the credentials are not encrypted (a `credentials` value must start with `{PREFIX}`: encrypt it with `copier-node credentials encrypt`)"
    )]
    NotEncrypted,
    #[error(
        "the credentials do not decrypt with this node's credentials key (a different key, or an altered value)"
    )]
    WrongKey,
    #[error("the credentials value is malformed ({0})")]
    Malformed(&'static str),
}

/// What rotating one stored value comes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reseal {
    /// Already encrypted with the current key.
    Current,
    /// Encrypted with an older key of the list: this is the value under the current key.
    Resealed(String),
    /// Stored in plaintext: the value encrypted with the current key, if asked for.
    Plaintext(Option<String>),
    /// Not readable with any key of the list.
    Unreadable(CredentialsError),
}

/// What `copier-node credentials rotate` did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rotation {
    /// Values re-encrypted from an older key to the current one.
    pub resealed: usize,
    /// Plaintext values encrypted (with `encrypt_plaintext`).
    pub encrypted: usize,
    /// Values already under the current key.
    pub current: usize,
    /// One line per value left as it was, naming its account and why.
    pub problems: Vec<String>,
}

/// Brings every stored value to the current key, each with a compare-and-set so an operator's
/// concurrent change wins; plaintext values are encrypted only with `encrypt_plaintext`.
pub async fn rotate(
    conn: &mut sqlx::PgConnection,
    key: &CredentialsKey,
    encrypt_plaintext: bool,
) -> Result<Rotation, sqlx::Error> {
    let mut r = Rotation::default();
    for (id, stored) in crate::db::credentials::stored(conn).await? {
        let (new, was_plaintext) = match reseal(
            key,
            &Secret::new(stored.clone()),
            encrypt_plaintext,
        ) {
            Reseal::Current => {
                r.current += 1;
                continue;
            }
            Reseal::Resealed(v) => (v, false),
            Reseal::Plaintext(Some(v)) => (v, true),
            Reseal::Plaintext(None) => {
                r.problems.push(format!(
                    "account {id}: the credentials are stored in plaintext (rerun with --encrypt-plaintext to encrypt them)"
                ));
                continue;
            }
            Reseal::Unreadable(e) => {
                r.problems.push(format!("account {id}: {e}; left as it is"));
                continue;
            }
        };
        if !crate::db::credentials::replace(conn, id, &stored, &new).await? {
            r.problems.push(format!(
                "account {id}: the value changed meanwhile; left as it is (run rotate again)"
            ));
        } else if was_plaintext {
            r.encrypted += 1;
        } else {
            r.resealed += 1;
        }
    }
    Ok(r)
}

/// Decides how to bring one stored value to the current key.
pub fn reseal(key: &CredentialsKey, stored: &Secret, encrypt_plaintext: bool) -> Reseal {
    if !stored.expose().trim().starts_with(PREFIX) {
        return Reseal::Plaintext(encrypt_plaintext.then(|| key.encrypt(stored.expose())));
    }
    if decrypt(Some(&key.current()), stored).is_ok() {
        return Reseal::Current;
    }
    match decrypt(Some(key), stored) {
        Ok(plain) => Reseal::Resealed(key.encrypt(plain.expose())),
        Err(e) => Reseal::Unreadable(e),
    }
}

/// Decrypts a `credentials` column value with the node's key (if it has one).
pub fn decrypt(key: Option<&CredentialsKey>, stored: &Secret) -> Result<Secret, CredentialsError> {
    let key = key.ok_or(CredentialsError::NoKey)?;
    let Some(body) = stored.expose().trim().strip_prefix(PREFIX) else {
        return Err(CredentialsError::NotEncrypted);
    };
    let raw = STANDARD
        .decode(body)
        .map_err(|_| CredentialsError::Malformed("not base64 after the prefix"))?;
    if raw.len() < NONCE_LEN + 16 {
        return Err(CredentialsError::Malformed(
            "too short to hold a nonce and a tag",
        ));
    }
    let (nonce, sealed) = raw.split_at(NONCE_LEN);
    let plain = key
        .0
        .iter()
        .find_map(|k| {
            CredentialsKey::cipher(k)
                .decrypt(Nonce::from_slice(nonce), sealed)
                .ok()
        })
        .ok_or(CredentialsError::WrongKey)?;
    String::from_utf8(plain)
        .map(Secret::new)
        .map_err(|_| CredentialsError::Malformed("the decrypted password is not UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_round_trips_and_two_encryptions_differ() {
        let key = CredentialsKey::generate();
        let a = key.encrypt("hunter2");
        let b = key.encrypt("hunter2");
        assert!(a.starts_with(PREFIX) && b.starts_with(PREFIX));
        assert_ne!(a, b, "a fresh nonce per value");
        assert!(!a.contains("hunter2"));
        let plain = decrypt(Some(&key), &Secret::new(a)).unwrap();
        assert_eq!(plain.expose(), "hunter2");
    }

    #[test]
    fn each_unusable_value_is_refused_for_its_own_reason() {
        let key = CredentialsKey::generate();
        let other = CredentialsKey::generate();
        let sealed = key.encrypt("pw");
        assert_eq!(
            decrypt(None, &Secret::new(sealed.clone())),
            Err(CredentialsError::NoKey)
        );
        assert_eq!(
            decrypt(Some(&other), &Secret::new(sealed.clone())),
            Err(CredentialsError::WrongKey)
        );
        assert_eq!(
            decrypt(Some(&key), &Secret::new("pw")),
            Err(CredentialsError::NotEncrypted)
        );
        assert_eq!(
            decrypt(None, &Secret::new("pw")),
            Err(CredentialsError::NoKey)
        );
        // One bit flipped in the ciphertext: the tag no longer matches.
        let mut raw = STANDARD.decode(&sealed[PREFIX.len()..]).unwrap();
        raw[NONCE_LEN] ^= 1;
        let altered = format!("{PREFIX}{}", STANDARD.encode(raw));
        assert_eq!(
            decrypt(Some(&key), &Secret::new(altered)),
            Err(CredentialsError::WrongKey)
        );
        assert!(matches!(
            decrypt(Some(&key), &Secret::new(format!("{PREFIX}???"))),
            Err(CredentialsError::Malformed(_))
        ));
        assert!(matches!(
            decrypt(Some(&key), &Secret::new(format!("{PREFIX}AAAA"))),
            Err(CredentialsError::Malformed(_))
        ));
    }

    #[test]
    fn keys_parse_from_base64_of_32_bytes_and_never_show() {
        let key = CredentialsKey::generate();
        let text = format!("{}\n", key.encode());
        assert_eq!(CredentialsKey::parse(&text).unwrap(), key);
        assert_eq!(format!("{key:?}"), "CredentialsKey(<1 redacted>)");
        let short = CredentialsKey::parse(&STANDARD.encode([1u8; 16])).unwrap_err();
        assert!(short.contains("the key decodes to 16 bytes"), "{short}");
        let second = format!("{},{}", key.encode(), STANDARD.encode([1u8; 16]));
        let err = CredentialsKey::parse(&second).unwrap_err();
        assert!(
            err.contains("key 2 of the list decodes to 16 bytes"),
            "{err}"
        );
        assert!(CredentialsKey::parse(" \n").is_err());
        let secret_looking = "not-base64-at-all!";
        let bad = CredentialsKey::parse(secret_looking).unwrap_err();
        assert!(!bad.contains(secret_looking), "{bad}");
    }

    #[test]
    fn a_rotation_decrypts_old_and_new_values_and_encrypts_with_the_new_key() {
        let old = CredentialsKey::generate();
        let new = CredentialsKey::generate();
        let before = old.encrypt("pw-old");
        let ring = CredentialsKey::parse(&format!("{}, {}\n", new.encode(), old.encode())).unwrap();
        assert_eq!(ring, new.clone().then(&old));
        assert_eq!(
            decrypt(Some(&ring), &Secret::new(before.clone()))
                .unwrap()
                .expose(),
            "pw-old"
        );
        let after = ring.encrypt("pw-new");
        assert_eq!(
            decrypt(Some(&new), &Secret::new(after.clone()))
                .unwrap()
                .expose(),
            "pw-new"
        );
        assert_eq!(
            decrypt(Some(&old), &Secret::new(after)),
            Err(CredentialsError::WrongKey),
            "new values use the first key"
        );
        assert_eq!(
            decrypt(Some(&new), &Secret::new(before)),
            Err(CredentialsError::WrongKey),
            "once the old key is dropped, its values no longer decrypt"
        );
    }

    #[test]
    fn resealing_brings_every_readable_value_to_the_current_key() {
        let old = CredentialsKey::generate();
        let new = CredentialsKey::generate();
        let ring = new.clone().then(&old);
        let stranger = CredentialsKey::generate();
        let check = |value: &str| reseal(&ring, &Secret::new(value), false);
        assert_eq!(check(&new.encrypt("a")), Reseal::Current);
        let Reseal::Resealed(v) = check(&old.encrypt("b")) else {
            panic!("an old key's value is resealed")
        };
        assert_eq!(decrypt(Some(&new), &Secret::new(v)).unwrap().expose(), "b");
        assert_eq!(check("plain"), Reseal::Plaintext(None));
        let Reseal::Plaintext(Some(v)) = reseal(&ring, &Secret::new("plain"), true) else {
            panic!("plaintext is encrypted when asked")
        };
        assert_eq!(
            decrypt(Some(&new), &Secret::new(v)).unwrap().expose(),
            "plain"
        );
        assert_eq!(
            check(&stranger.encrypt("c")),
            Reseal::Unreadable(CredentialsError::WrongKey)
        );
    }
}
