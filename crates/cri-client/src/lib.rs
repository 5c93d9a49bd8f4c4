//! A blocking client of the Kubernetes Container Runtime Interface (CRI) over a Unix socket, for the tests
//! that drive a real engine (containerd) the way the kubelet does: `RunPodSandbox`, `CreateContainer`,
//! `StartContainer`, `CheckpointContainer` (KEP-2008), a restore by `CreateContainer` from a checkpoint
//! archive, `ExecSync`, and the clean-up calls. crictl is not packaged here; the protocol subset is in
//! `proto/cri.proto`.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// The CRI's messages and the runtime service's client, generated from `proto/cri.proto`.
#[allow(clippy::all, missing_docs)]
pub mod api {
    tonic::include_proto!("runtime.v1");
}

use api::runtime_service_client::RuntimeServiceClient;

/// What a call failed with: the connection, or the engine's gRPC status (its message is the engine's
/// error text, as the kubelet gets it).
#[derive(Debug)]
pub enum Error {
    Connect(String),
    Status(tonic::Status),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Connect(e) => write!(f, "connecting to the CRI socket: {e}"),
            Error::Status(s) => write!(f, "{:?}: {}", s.code(), s.message()),
        }
    }
}

impl std::error::Error for Error {}

impl From<tonic::Status> for Error {
    fn from(s: tonic::Status) -> Self {
        Error::Status(s)
    }
}

/// Dials the same Unix socket whatever URI tonic asks for.
#[derive(Clone)]
struct UnixConnector(PathBuf);

type Dialing = Pin<
    Box<
        dyn Future<Output = std::io::Result<hyper_util::rt::TokioIo<tokio::net::UnixStream>>>
            + Send,
    >,
>;

impl tower_service::Service<tonic::transport::Uri> for UnixConnector {
    type Response = hyper_util::rt::TokioIo<tokio::net::UnixStream>;
    type Error = std::io::Error;
    type Future = Dialing;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: tonic::transport::Uri) -> Self::Future {
        let path = self.0.clone();
        Box::pin(async move {
            let s = tokio::net::UnixStream::connect(path).await?;
            Ok(hyper_util::rt::TokioIo::new(s))
        })
    }
}

/// A connection to one engine's CRI socket.
pub struct Cri {
    rt: tokio::runtime::Runtime,
    client: RuntimeServiceClient<tonic::transport::Channel>,
    /// Each call's deadline (the kubelet's default is 2 minutes).
    timeout: Duration,
}

impl Cri {
    /// Connects to the CRI socket at `socket`.
    pub fn connect(socket: &Path, timeout: Duration) -> Result<Cri, Error> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Connect(e.to_string()))?;
        let connector = UnixConnector(socket.to_path_buf());
        let channel = rt
            .block_on(
                // The address is never dialled: the connector reaches the socket.
                tonic::transport::Endpoint::from_static("http://cri.invalid")
                    .connect_timeout(Duration::from_secs(5))
                    .connect_with_connector(connector),
            )
            .map_err(|e| Error::Connect(format!("{}: {e}", socket.display())))?;
        Ok(Cri {
            rt,
            client: RuntimeServiceClient::new(channel),
            timeout,
        })
    }

    fn call<T, Fut>(
        &mut self,
        f: impl FnOnce(RuntimeServiceClient<tonic::transport::Channel>) -> Fut,
    ) -> Result<T, Error>
    where
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let client = self.client.clone();
        let timeout = self.timeout;
        self.rt.block_on(async move {
            match tokio::time::timeout(timeout, f(client)).await {
                Ok(r) => Ok(r?.into_inner()),
                Err(_) => Err(Error::Status(tonic::Status::deadline_exceeded(format!(
                    "no answer within {timeout:?}"
                )))),
            }
        })
    }

    pub fn version(&mut self) -> Result<api::VersionResponse, Error> {
        self.call(|mut c| async move {
            c.version(api::VersionRequest {
                version: "v1".into(),
            })
            .await
        })
    }

    /// `RunPodSandbox`: the sandbox's id.
    pub fn run_pod(&mut self, config: &api::PodSandboxConfig) -> Result<String, Error> {
        let req = api::RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: String::new(),
        };
        self.call(|mut c| async move { c.run_pod_sandbox(req).await })
            .map(|r| r.pod_sandbox_id)
    }

    /// `StopPodSandbox` then `RemovePodSandbox` (its containers with it).
    pub fn remove_pod(&mut self, id: &str) -> Result<(), Error> {
        let id = id.to_string();
        let stop = api::StopPodSandboxRequest {
            pod_sandbox_id: id.clone(),
        };
        self.call(|mut c| async move { c.stop_pod_sandbox(stop).await })?;
        let remove = api::RemovePodSandboxRequest { pod_sandbox_id: id };
        self.call(|mut c| async move { c.remove_pod_sandbox(remove).await })
            .map(drop)
    }

    /// `CreateContainer` in pod `pod`: the container's id.
    pub fn create(
        &mut self,
        pod: &str,
        config: &api::ContainerConfig,
        sandbox: &api::PodSandboxConfig,
    ) -> Result<String, Error> {
        let req = api::CreateContainerRequest {
            pod_sandbox_id: pod.to_string(),
            config: Some(config.clone()),
            sandbox_config: Some(sandbox.clone()),
        };
        self.call(|mut c| async move { c.create_container(req).await })
            .map(|r| r.container_id)
    }

    pub fn start(&mut self, id: &str) -> Result<(), Error> {
        let req = api::StartContainerRequest {
            container_id: id.to_string(),
        };
        self.call(|mut c| async move { c.start_container(req).await })
            .map(drop)
    }

    /// `StopContainer` (killed after `grace`) then `RemoveContainer`.
    pub fn remove(&mut self, id: &str, grace: Duration) -> Result<(), Error> {
        let stop = api::StopContainerRequest {
            container_id: id.to_string(),
            timeout: grace.as_secs() as i64,
        };
        self.call(|mut c| async move { c.stop_container(stop).await })?;
        let remove = api::RemoveContainerRequest {
            container_id: id.to_string(),
        };
        self.call(|mut c| async move { c.remove_container(remove).await })
            .map(drop)
    }

    /// Every container the engine knows, in every state.
    pub fn list(&mut self) -> Result<Vec<api::Container>, Error> {
        let req = api::ListContainersRequest { filter: None };
        self.call(|mut c| async move { c.list_containers(req).await })
            .map(|r| r.containers)
    }

    /// `ContainerStatus` with its verbose `info` (the engine's JSON: its PID, its runtime spec).
    pub fn status(&mut self, id: &str) -> Result<api::ContainerStatusResponse, Error> {
        let req = api::ContainerStatusRequest {
            container_id: id.to_string(),
            verbose: true,
        };
        self.call(|mut c| async move { c.container_status(req).await })
    }

    /// `ExecSync`: the command's exit code, stdout and stderr.
    pub fn exec(&mut self, id: &str, cmd: &[&str]) -> Result<api::ExecSyncResponse, Error> {
        let req = api::ExecSyncRequest {
            container_id: id.to_string(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            timeout: 30,
        };
        self.call(|mut c| async move { c.exec_sync(req).await })
    }

    /// `CheckpointContainer` (KEP-2008): the engine writes the checkpoint archive to `location`.
    pub fn checkpoint(
        &mut self,
        id: &str,
        location: &Path,
        timeout: Duration,
    ) -> Result<(), Error> {
        let req = api::CheckpointContainerRequest {
            container_id: id.to_string(),
            location: location.display().to_string(),
            timeout: timeout.as_secs() as i64,
        };
        self.call(|mut c| async move { c.checkpoint_container(req).await })
            .map(drop)
    }
}
