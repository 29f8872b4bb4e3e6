//! `[encryption]`: where spoold gets the key-encryption key that wraps encrypted volumes'
//! data keys (docs/encryption.md), and reading it: a key file only spoold's user can read, a
//! systemd credential (`LoadCredentialEncrypted=`), or an operator's command that prints it
//! (the hook for a KMS or a TPM). Exactly one of them.

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use serde::Deserialize;
use spool_crypt::Kek;
use zeroize::Zeroizing;

use super::ConfigError;

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEncryption {
    key_file: Option<PathBuf>,
    credential: Option<String>,
    key_command: Option<String>,
}

/// Where the key-encryption key comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// A file of 32 bytes (or 64 hex digits) that only spoold's user may read.
    File(PathBuf),
    /// A systemd credential: `$CREDENTIALS_DIRECTORY/NAME`.
    Credential(String),
    /// A command run with `sh -c` that prints the key on its standard output.
    Command(String),
}

impl RawEncryption {
    pub(super) fn source(self) -> Result<Option<KeySource>, ConfigError> {
        let given = [
            self.key_file.map(KeySource::File),
            self.credential.map(KeySource::Credential),
            self.key_command.map(KeySource::Command),
        ];
        let mut given = given.into_iter().flatten();
        let one = given.next();
        if given.next().is_some() {
            return Err(ConfigError::Encryption(
                "give one of key_file, credential and key_command".into(),
            ));
        }
        if let Some(KeySource::Credential(c)) = &one {
            if c.is_empty() || c.contains('/') {
                return Err(ConfigError::Encryption(format!(
                    "credential {c:?} is not a credential name"
                )));
            }
        }
        Ok(one)
    }
}

impl std::fmt::Display for KeySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeySource::File(p) => write!(f, "key file {}", p.display()),
            KeySource::Credential(c) => write!(f, "credential {c}"),
            KeySource::Command(c) => write!(f, "key command `{c}`"),
        }
    }
}

impl KeySource {
    /// Reads the key. Errors say what to fix; none contains key material.
    pub fn load(&self) -> Result<Kek, KekError> {
        let material = match self {
            KeySource::File(p) => read_private(p)?,
            KeySource::Credential(name) => {
                let dir = std::env::var_os("CREDENTIALS_DIRECTORY")
                    .ok_or_else(|| KekError::NoCredentials(name.clone()))?;
                read_private(&PathBuf::from(dir).join(name))?
            }
            KeySource::Command(cmd) => run(cmd)?,
        };
        Kek::from_material(&material).map_err(|why| KekError::Material {
            from: self.clone(),
            why,
        })
    }
}

/// Why the key-encryption key cannot be read: the text says what to fix and holds no key
/// material.
#[derive(Debug, thiserror::Error)]
pub enum KekError {
    #[error("key file {}: {why}", .path.display())]
    File { path: PathBuf, why: std::io::Error },
    #[error("key file {}: must be a regular file owned by uid {me} that only it can read (mode {mode:o}, owner {uid}): chmod 600 it", .path.display())]
    NotPrivate {
        path: PathBuf,
        me: u32,
        mode: u32,
        uid: u32,
    },
    #[error("credential {0}: $CREDENTIALS_DIRECTORY is not set (start spoold from a systemd unit with LoadCredential= or LoadCredentialEncrypted=)")]
    NoCredentials(String),
    #[error("key command `{cmd}`: {why}")]
    Spawn { cmd: String, why: std::io::Error },
    #[error("key command `{cmd}` failed: {status}")]
    Failed {
        cmd: String,
        status: std::process::ExitStatus,
    },
    #[error("{from}: {why}")]
    Material {
        from: KeySource,
        why: spool_crypt::KeyError,
    },
}

/// A key file's bytes, refused unless it is a regular file owned by us that no one else can
/// read or write.
pub fn read_private(p: &std::path::Path) -> Result<Zeroizing<Vec<u8>>, KekError> {
    let io = |why| KekError::File {
        path: p.to_path_buf(),
        why,
    };
    let f = std::fs::File::open(p).map_err(io)?;
    let m = f.metadata().map_err(io)?;
    // SAFETY: geteuid has no arguments and cannot fail.
    let me = unsafe { libc::geteuid() };
    if !m.is_file() || m.uid() != me || m.mode() & 0o077 != 0 {
        return Err(KekError::NotPrivate {
            path: p.to_path_buf(),
            me,
            mode: m.mode() & 0o7777,
            uid: m.uid(),
        });
    }
    let mut buf = Zeroizing::new(Vec::with_capacity(128));
    f.take(4096).read_to_end(&mut buf).map_err(io)?;
    Ok(buf)
}

fn run(cmd: &str) -> Result<Zeroizing<Vec<u8>>, KekError> {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|why| KekError::Spawn {
            cmd: cmd.into(),
            why,
        })?;
    let stdout = Zeroizing::new(out.stdout);
    if !out.status.success() {
        return Err(KekError::Failed {
            cmd: cmd.into(),
            status: out.status,
        });
    }
    Ok(stdout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn sources_load_and_refuse_what_they_should() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("kek");
        std::fs::write(&p, "ab".repeat(32)).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = KeySource::File(p.clone()).load().unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let k = KeySource::File(p.clone()).load().unwrap();
        let c = KeySource::Command(format!("cat {}", p.display()))
            .load()
            .unwrap();
        assert_eq!(k.id(), c.id());
        let e = (KeySource::Command("exit 3".into()).load().unwrap_err()).to_string();
        assert!(e.contains("failed"), "{e}");
        let e = (KeySource::Command("echo short".into()).load().unwrap_err()).to_string();
        assert!(e.contains("32 bytes"), "{e}");
        let e = (KeySource::File(d.path().join("none")).load().unwrap_err()).to_string();
        assert!(e.contains("No such file"), "{e}");
    }

    #[test]
    fn exactly_one_source() {
        let two = RawEncryption {
            key_file: Some("/k".into()),
            key_command: Some("x".into()),
            credential: None,
        };
        assert!(two.source().is_err());
        assert_eq!(RawEncryption::default().source().unwrap(), None);
        let bad = RawEncryption {
            credential: Some("../x".into()),
            ..Default::default()
        };
        assert!(bad.source().is_err());
    }
}
