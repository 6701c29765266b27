//! A minimal HTTPS client for the tests (what Prometheus does when it scrapes): one
//! `GET` over TLS with an optional bearer token, trusting one CA or, for a self-signed serving
//! certificate (`insecureSkipVerify`), any certificate. Over a TCP connection of its own or any
//! stream the caller opened (e.g. one inside a pod's network namespace).

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::client::danger::{
    HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier,
};
use tokio_rustls::rustls::crypto::{self, CryptoProvider};
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use tokio_rustls::rustls::{self, ClientConfig, DigitallySignedStruct, RootCertStore};

/// Which server certificates the client accepts.
#[derive(Clone, Debug)]
pub enum Trust {
    /// Any (`insecureSkipVerify`): the operator's self-signed certificate.
    Any,
    /// Those issued by this CA for the name asked for.
    Ca(CertificateDer<'static>),
}

/// A response: status code, header lines, body.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(crypto::ring::default_provider())
}

/// Accepts every certificate, but still checks the handshake's signatures with it.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

fn client_config(trust: &Trust) -> ClientConfig {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap();
    match trust {
        Trust::Any => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
            .with_no_client_auth(),
        Trust::Ca(ca) => {
            let mut roots = RootCertStore::empty();
            roots.add(ca.clone()).unwrap();
            builder.with_root_certificates(roots).with_no_client_auth()
        }
    }
}

/// `GET path` over TLS on `stream`, for server name `name`, with `Authorization: Bearer token`
/// when a token is given. A TLS failure (e.g. an untrusted certificate) is an error.
pub async fn get_over<S>(
    stream: S,
    name: &str,
    path: &str,
    token: Option<&str>,
    trust: &Trust,
) -> std::io::Result<Response>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let connector = TlsConnector::from(Arc::new(client_config(trust)));
    let server_name = ServerName::try_from(name.to_string()).map_err(std::io::Error::other)?;
    let mut tls = connector.connect(server_name, stream).await?;
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    tls.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {name}\r\n{auth}Connection: close\r\n\r\n")
            .as_bytes(),
    )
    .await?;
    tls.flush().await?;
    let mut raw = Vec::new();
    match tls.read_to_end(&mut raw).await {
        Ok(_) => {}
        // A server that closes without TLS close_notify, after the whole response.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(e),
    }
    parse(&raw)
}

/// [`get_over`] a new TCP connection to `addr`.
pub async fn get(
    addr: SocketAddr,
    name: &str,
    path: &str,
    token: Option<&str>,
    trust: &Trust,
) -> std::io::Result<Response> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    get_over(tcp, name, path, token, trust).await
}

/// `GET path` over plain HTTP on a new TCP connection to `addr`.
pub async fn get_plain(addr: SocketAddr, path: &str) -> std::io::Result<Response> {
    let mut tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut raw = Vec::new();
    tcp.read_to_end(&mut raw).await?;
    parse(&raw)
}

fn parse(raw: &[u8]) -> std::io::Result<Response> {
    let text = String::from_utf8_lossy(raw);
    let bad = || std::io::Error::other(format!("not an HTTP response: {text:?}"));
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(bad)?;
    let (status_line, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(bad)?;
    Ok(Response {
        status,
        headers: headers.to_string(),
        body: body.to_string(),
    })
}
