//! TLS for `/metrics`: the certificate from `--metrics-cert-dir` (`tls.crt`, `tls.key`, as a
//! `kubernetes.io/tls` Secret such as cert-manager's is mounted; re-read when they change, so a
//! renewed certificate is served without a restart), or else a self-signed one made at start, as
//! controller-runtime does.
//!
//! rustls with the `ring` provider, through `tokio-rustls`: both are already in the tree as
//! kube's TLS stack, so serving HTTPS adds only `rcgen` (the self-signed certificate). The accept
//! loop is a few lines here rather than `axum-server`: handshakes run in tasks of their own, so
//! a client that connects and stays silent delays no other scrape.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::server::TlsStream;
use tracing::{debug, info, warn};

/// The certificate file of a `kubernetes.io/tls` Secret.
pub const CERT_FILE: &str = "tls.crt";
/// The key file of a `kubernetes.io/tls` Secret.
pub const KEY_FILE: &str = "tls.key";
/// How often, at most, the certificate directory is read again (on a handshake).
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(10);
/// A client must finish its TLS handshake within this time.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// At most this many connections to `/metrics` at once, TLS handshakes under way included (a
/// Prometheus keeps one per replica): the rest wait in the kernel's listen backlog, so a flood
/// of connections costs neither file descriptors nor memory beyond these.
pub const MAX_CONNECTIONS: usize = 64;

/// The names the self-signed certificate is made for (scrapers skip its verification anyway:
/// there is no CA to verify it with).
const SELF_SIGNED_NAMES: [&str; 2] = ["localhost", "127.0.0.1"];

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Where the serving certificate comes from.
#[derive(Clone, Debug)]
pub enum CertSource {
    /// Made at start, self-signed, kept in memory only.
    SelfSigned,
    /// `tls.crt` (the certificate, then its chain) and `tls.key` in this directory.
    Dir(PathBuf),
}

/// The server's TLS configuration (TLS 1.2 and 1.3, HTTP/1.1).
pub fn server_config(source: &CertSource) -> Result<Arc<ServerConfig>, String> {
    let provider = provider();
    let resolver: Arc<dyn ResolvesServerCert> = match source {
        CertSource::SelfSigned => Arc::new(Fixed(Arc::new(self_signed(&provider)?))),
        CertSource::Dir(dir) => Arc::new(DirResolver::new(dir, RELOAD_INTERVAL)?),
    };
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

fn self_signed(provider: &CryptoProvider) -> Result<CertifiedKey, String> {
    let names: Vec<String> = SELF_SIGNED_NAMES.iter().map(|s| s.to_string()).collect();
    let mut params = rcgen::CertificateParams::new(names).map_err(|e| e.to_string())?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "gpu-sharing-operator metrics");
    let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
    let cert = params.self_signed(&key).map_err(|e| e.to_string())?;
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    CertifiedKey::from_der(vec![cert.der().clone()], key, provider).map_err(|e| e.to_string())
}

#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl ResolvesServerCert for Fixed {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// The PEM files of a certificate directory, as last read.
type Files = (Vec<u8>, Vec<u8>);

fn read_files(dir: &Path) -> io::Result<Files> {
    Ok((
        std::fs::read(dir.join(CERT_FILE))?,
        std::fs::read(dir.join(KEY_FILE))?,
    ))
}

fn parse(files: &Files, provider: &CryptoProvider) -> Result<CertifiedKey, String> {
    let chain = CertificateDer::pem_slice_iter(&files.0)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{CERT_FILE}: {e}"))?;
    if chain.is_empty() {
        return Err(format!("{CERT_FILE}: no certificate"));
    }
    let key = PrivateKeyDer::from_pem_slice(&files.1).map_err(|e| format!("{KEY_FILE}: {e}"))?;
    CertifiedKey::from_der(chain, key, provider).map_err(|e| e.to_string())
}

/// The certificate of a directory, read again (at most every `interval`, on a handshake) when
/// its files changed; a change that does not parse keeps the previous certificate.
#[derive(Debug)]
pub struct DirResolver {
    dir: PathBuf,
    interval: Duration,
    provider: Arc<CryptoProvider>,
    state: Mutex<DirState>,
}

#[derive(Debug)]
struct DirState {
    files: Files,
    key: Arc<CertifiedKey>,
    checked: Instant,
}

impl DirResolver {
    /// Reads the directory now: a missing or bad certificate fails the start.
    pub fn new(dir: &Path, interval: Duration) -> Result<Self, String> {
        let provider = provider();
        let files = read_files(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let key = parse(&files, &provider).map_err(|e| format!("{}: {e}", dir.display()))?;
        Ok(DirResolver {
            dir: dir.to_path_buf(),
            interval,
            provider,
            state: Mutex::new(DirState {
                files,
                key: Arc::new(key),
                checked: Instant::now(),
            }),
        })
    }

    /// The certificate to serve now.
    pub fn current(&self) -> Arc<CertifiedKey> {
        let mut s = self.state.lock().unwrap();
        if s.checked.elapsed() >= self.interval {
            s.checked = Instant::now();
            match read_files(&self.dir) {
                Ok(files) if files != s.files => {
                    match parse(&files, &self.provider) {
                        Ok(key) => {
                            info!(dir = %self.dir.display(), "metrics certificate reloaded");
                            s.key = Arc::new(key);
                        }
                        Err(e) => {
                            warn!(dir = %self.dir.display(), error = %e, "metrics certificate changed but does not load; serving the previous one");
                        }
                    }
                    s.files = files;
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(dir = %self.dir.display(), error = %e, "cannot read the metrics certificate; serving the previous one");
                }
            }
        }
        s.key.clone()
    }
}

impl ResolvesServerCert for DirResolver {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// A connection that holds one of its listener's permits until it is closed.
pub struct Capped<S> {
    io: S,
    _permit: OwnedSemaphorePermit,
}

impl<S: AsyncRead + Unpin> AsyncRead for Capped<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Capped<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, b)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// A listener that accepts a connection only while fewer than its cap are open (plain HTTP
/// `/metrics`, `--metrics-insecure`; [`TlsListener`] caps its own).
pub struct CappedListener<L> {
    inner: L,
    cap: Arc<Semaphore>,
}

impl<L> CappedListener<L> {
    pub fn new(inner: L, max: usize) -> Self {
        CappedListener {
            inner,
            cap: Arc::new(Semaphore::new(max)),
        }
    }
}

impl<L: axum::serve::Listener> axum::serve::Listener for CappedListener<L> {
    type Io = Capped<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let Ok(permit) = self.cap.clone().acquire_owned().await else {
            // Never closed.
            return std::future::pending().await;
        };
        let (io, addr) = self.inner.accept().await;
        (
            Capped {
                io,
                _permit: permit,
            },
            addr,
        )
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

type Accepted = (Capped<TlsStream<TcpStream>>, SocketAddr);

/// A TCP listener whose connections come out TLS-terminated, for `axum::serve`: each handshake
/// runs in a task of its own (at most [`HANDSHAKE_TIMEOUT`]), so a slow client blocks no other,
/// and at most a cap of connections (handshakes included) are open at once. Dropping it stops
/// accepting and frees the port.
pub struct TlsListener {
    rx: mpsc::Receiver<Accepted>,
    local: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    /// At most [`MAX_CONNECTIONS`] connections.
    pub fn new(tcp: TcpListener, config: Arc<ServerConfig>) -> io::Result<Self> {
        Self::with_cap(tcp, config, MAX_CONNECTIONS)
    }

    pub fn with_cap(tcp: TcpListener, config: Arc<ServerConfig>, max: usize) -> io::Result<Self> {
        let local = tcp.local_addr()?;
        let acceptor = TlsAcceptor::from(config);
        let cap = Arc::new(Semaphore::new(max));
        let (tx, rx) = mpsc::channel(32);
        let accept = tokio::spawn(async move {
            loop {
                // A turn first: beyond the cap, connections wait in the backlog.
                let Ok(permit) = cap.clone().acquire_owned().await else {
                    return;
                };
                let (stream, peer) = match tcp.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of file descriptors and the like: wait rather than spin.
                        debug!(error = %e, "metrics: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(io)) => {
                            let _permit = permit;
                            let _ = tx.send((Capped { io, _permit }, peer)).await;
                        }
                        Ok(Err(e)) => debug!(%peer, error = %e, "metrics: TLS handshake failed"),
                        Err(_) => debug!(%peer, "metrics: TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { rx, local, accept })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = Capped<TlsStream<TcpStream>>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept task is gone (only when dropped): accept nothing more.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A certificate for `name` and its key, as PEM files.
    fn pem_pair(name: &str) -> (String, String) {
        let c = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
        (c.cert.pem(), c.signing_key.serialize_pem())
    }

    fn write(dir: &Path, (cert, key): &(String, String)) {
        std::fs::write(dir.join(CERT_FILE), cert).unwrap();
        std::fs::write(dir.join(KEY_FILE), key).unwrap();
    }

    fn der_of(pem: &str) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
    }

    #[test]
    fn a_certificate_directory_is_read_again_when_it_changes() {
        let dir = tempfile::tempdir().unwrap();
        assert!(
            DirResolver::new(dir.path(), Duration::ZERO).is_err(),
            "no files: the start fails"
        );
        let a = pem_pair("a.example");
        write(dir.path(), &a);
        let r = DirResolver::new(dir.path(), Duration::ZERO).unwrap();
        assert_eq!(r.current().cert[0], der_of(&a.0));

        // Renewed (cert-manager writes a new Secret, the kubelet updates the files).
        let b = pem_pair("b.example");
        write(dir.path(), &b);
        assert_eq!(r.current().cert[0], der_of(&b.0));

        // A half-written or mismatched pair keeps the last good certificate.
        write(dir.path(), &(a.0.clone(), b.1.clone()));
        assert_eq!(r.current().cert[0], der_of(&b.0));
        std::fs::write(dir.path().join(KEY_FILE), "not a key").unwrap();
        assert_eq!(r.current().cert[0], der_of(&b.0));
        std::fs::remove_file(dir.path().join(CERT_FILE)).unwrap();
        assert_eq!(r.current().cert[0], der_of(&b.0));

        // Not read again before the interval.
        let slow = DirResolver::new(
            {
                write(dir.path(), &a);
                dir.path()
            },
            Duration::from_secs(3600),
        )
        .unwrap();
        write(dir.path(), &b);
        assert_eq!(slow.current().cert[0], der_of(&a.0));
    }

    #[tokio::test]
    async fn connections_beyond_the_cap_wait_until_one_closes() {
        use axum::serve::Listener;
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let mut l = CappedListener::new(tcp, 2);
        let _clients: Vec<_> = futures::future::join_all((0..3).map(|_| TcpStream::connect(addr)))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let first = l.accept().await.0;
        let _second = l.accept().await.0;
        let wait = Duration::from_millis(200);
        assert!(
            tokio::time::timeout(wait, l.accept()).await.is_err(),
            "a third connection while two are open"
        );
        drop(first);
        assert!(tokio::time::timeout(wait, l.accept()).await.is_ok());
    }

    #[tokio::test]
    async fn silent_handshakes_count_against_the_tls_cap() {
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let config = server_config(&CertSource::SelfSigned).unwrap();
        let _l = TlsListener::with_cap(tcp, config, 1).unwrap();
        // One client connects and says nothing: it holds the only turn.
        let silent = TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        // A second connects (the kernel completes it) but is not accepted: its ClientHello is
        // never answered.
        let mut second = TcpStream::connect(addr).await.unwrap();
        let hello = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let mut conn =
            rustls::ClientConnection::new(Arc::new(hello), "localhost".try_into().unwrap())
                .unwrap();
        let mut out = Vec::new();
        conn.write_tls(&mut out).unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        second.write_all(&out).await.unwrap();
        let mut buf = [0u8; 16];
        let read = tokio::time::timeout(Duration::from_millis(300), second.read(&mut buf)).await;
        assert!(read.is_err(), "no ServerHello while the cap is taken");
        // The silent client leaves: the second is accepted and answered.
        drop(silent);
        let read = tokio::time::timeout(Duration::from_secs(5), second.read(&mut buf)).await;
        assert!(matches!(read, Ok(Ok(n)) if n > 0), "{read:?}");
    }

    #[test]
    fn the_self_signed_certificate_matches_its_key() {
        let k = self_signed(&provider()).unwrap();
        k.keys_match().unwrap();
        assert!(server_config(&CertSource::SelfSigned).is_ok());
    }
}
