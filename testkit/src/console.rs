//! The console of a test environment, served in-process on a free loopback
//! port with two tokens: [`ADMIN`] (named `ops`) and [`VIEWER`] (named
//! `viewer`, read-only).

use std::net::SocketAddr;

use shardline_connect::inbound::Inbound;
use shardline_console::{Config, Tokens};
use shardline_ops::ReconcileConfig;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::TestEnv;

/// The admin token, named `ops`.
pub const ADMIN: &str = "admin-token-0123456789";
/// The read-only token, named `viewer`.
pub const VIEWER: &str = "viewer-token-0123456789";

/// A console serving until [`Self::stop`].
pub struct ServedConsole {
    pub addr: SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), shardline_console::Error>>,
}

impl ServedConsole {
    /// Serves `env`'s fleet; with `reconcile`, its reconcile page offers a dry run.
    pub async fn start(env: &TestEnv, reconcile: Option<ReconcileConfig>) -> Self {
        Self::start_with(env, reconcile, Inbound::default()).await
    }

    /// [`Self::start`] with its port under `limits` (short timeouts for a test).
    pub async fn start_with(
        env: &TestEnv,
        reconcile: Option<ReconcileConfig>,
        limits: Inbound,
    ) -> Self {
        Self::start_configured(env, |c| {
            c.reconcile = reconcile;
            c.limits = limits;
        })
        .await
    }

    /// [`Self::start`] with `configure` applied to its config.
    pub async fn start_configured(env: &TestEnv, configure: impl FnOnce(&mut Config)) -> Self {
        let mut config = Config {
            tokens: Tokens::parse(
                &format!("# test tokens\nops:admin:{ADMIN}\nviewer:read-only:{VIEWER}\n"),
                false,
            )
            .unwrap(),
            base_path: "/".into(),
            ..Config::default()
        };
        configure(&mut config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(shardline_console::serve(
            config,
            env.ops_fleet(),
            listener,
            shutdown.clone(),
        ));
        Self {
            addr,
            shutdown,
            task,
        }
    }

    /// Stops it; panics unless it was still serving and stopped cleanly.
    pub async fn stop(self) {
        assert!(
            !self.task.is_finished(),
            "the console stopped: {:?}",
            self.task.await
        );
        self.shutdown.cancel();
        self.task.await.unwrap().unwrap();
    }
}
