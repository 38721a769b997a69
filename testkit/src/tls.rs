//! TLS for tests: a throwaway CA and a `localhost` server certificate made
//! with the `openssl` command line, `socat` terminating TLS in front of a
//! broker, and a broker user of its own (so its password is distinctive in logs).

use std::path::PathBuf;
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::broker::{Ctl, free_port};
use crate::env::TestEnv;
use crate::process::{Helper, assert_exited_ok};
use crate::wait::wait_until;

/// A throwaway CA and a `localhost` server certificate it signed, made with the
/// `openssl` command line.
pub struct Pki {
    pub dir: PathBuf,
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Pki {
    pub fn generate(id: &str) -> Self {
        let dir = crate::paths::scratch(&format!("tls-{id}"));
        std::fs::write(
            dir.join("openssl.cnf"),
            "[req]\n\
             distinguished_name = dn\n\
             prompt = no\n\
             [dn]\n\
             CN = shardline test\n\
             [v3_ca]\n\
             basicConstraints = critical, CA:TRUE\n\
             keyUsage = critical, keyCertSign, cRLSign\n\
             subjectKeyIdentifier = hash\n\
             [v3_server]\n\
             basicConstraints = critical, CA:FALSE\n\
             keyUsage = critical, digitalSignature, keyEncipherment\n\
             extendedKeyUsage = serverAuth\n\
             subjectAltName = DNS:localhost, IP:127.0.0.1\n\
             subjectKeyIdentifier = hash\n\
             authorityKeyIdentifier = keyid\n",
        )
        .unwrap();
        let serial = format!("0x{:x}", unique());
        let ca_subject = format!("/CN=shardline test CA {id}");
        let genkey = |out| {
            [
                "genpkey",
                "-algorithm",
                "EC",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-out",
                out,
            ]
        };
        let (ca_key, server_key) = (genkey("ca.key"), genkey("server.key"));
        let steps: [&[&str]; 5] = [
            &ca_key,
            &[
                "req",
                "-config",
                "openssl.cnf",
                "-new",
                "-x509",
                "-key",
                "ca.key",
                "-subj",
                &ca_subject,
                "-extensions",
                "v3_ca",
                "-days",
                "2",
                "-out",
                "ca.pem",
            ],
            &server_key,
            &[
                "req",
                "-config",
                "openssl.cnf",
                "-new",
                "-key",
                "server.key",
                "-subj",
                "/CN=localhost",
                "-out",
                "server.csr",
            ],
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-set_serial",
                &serial,
                "-days",
                "2",
                "-extfile",
                "openssl.cnf",
                "-extensions",
                "v3_server",
                "-out",
                "server.pem",
            ],
        ];
        for args in steps {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .output()
                .unwrap_or_else(|e| {
                    panic!(
                        "this test needs the `openssl` command line to make its certificates \
                         (apt-get install openssl): cannot run it: {e}"
                    )
                });
            assert_exited_ok(&format!("openssl {args:?}"), &out);
        }
        Self {
            ca: dir.join("ca.pem"),
            cert: dir.join("server.pem"),
            key: dir.join("server.key"),
            dir,
        }
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        // Kept after a failure: the helper logs and the worker log are in there.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A RabbitMQ user with full rights on the test's vhost, deleted on drop.
pub struct BrokerUser {
    pub name: String,
    pub password: String,
    broker: Ctl,
}

impl BrokerUser {
    pub async fn create(env: &TestEnv) -> Self {
        let name = format!("shardline-{}", env.id);
        let password = format!("Amqp{:x}Secret", unique());
        let broker = env.broker().clone();
        broker.run(&["add_user", &name, &password]).await;
        broker
            .run(&["set_permissions", "-p", &env.vhost, &name, ".*", ".*", ".*"])
            .await;
        Self {
            name,
            password,
            broker,
        }
    }
}

impl Drop for BrokerUser {
    fn drop(&mut self) {
        let out = self.broker.run_blocking(&["-q", "delete_user", &self.name]);
        match out {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!(
                "cleanup: delete_user {} failed: {}",
                self.name,
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => eprintln!("cleanup: cannot run rabbitmqctl: {e}"),
        }
    }
}

/// `socat` terminating TLS in front of the local RabbitMQ.
pub struct TlsTerminator {
    pub port: u16,
    _process: Helper,
}

impl TlsTerminator {
    /// Listens with TLS on a free port and forwards to `127.0.0.1:backend`.
    pub async fn start(pki: &Pki, backend: u16) -> Self {
        let port = free_port();
        let listen = format!(
            "OPENSSL-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork,cert={},key={},verify=0",
            pki.cert.display(),
            pki.key.display()
        );
        let mut cmd = Command::new("socat");
        cmd.args([listen.as_str(), &format!("TCP:127.0.0.1:{backend}")]);
        let mut process = Helper::spawn("socat", &mut cmd, pki.dir.join("socat.log"));
        wait_until("socat to listen", crate::STARTUP, || {
            process.assert_running();
            async move {
                tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            }
        })
        .await;
        Self {
            port,
            _process: process,
        }
    }
}

/// Distinct per call, for serials and passwords.
pub fn unique() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
        ^ (u128::from(std::process::id()) << 64)
}
