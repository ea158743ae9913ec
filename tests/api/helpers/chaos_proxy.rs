//! A TCP proxy between the service and one database that a test can cut or sever.

use std::sync::Arc;

/// A TCP proxy the test controls, between the service and one database: when cut, it
/// stops forwarding on every connection (open ones go silent mid-query, new ones are
/// accepted and not answered) until healed, as a network partition would; `sever` closes
/// every open connection at once. `sever_after` / `cut_after` do either once the database
/// has sent that many more bytes through it: mid-stream by construction, whatever the
/// machine's socket buffers hold (on loopback they grow to 32 MB each, so "after the client's
/// first chunk" could come after the whole answer had left the database).
pub struct ChaosProxy {
    pub port: u16,
    cut: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
    /// The open connections' pumps, so `sever` can close them.
    links: Links,
    /// An armed fault: the bytes the database may still send, and the fault.
    trip: Arc<std::sync::Mutex<Option<(usize, Fault)>>>,
}

type Links = Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>;

/// What an armed [`ChaosProxy`] does once its bytes have passed.
#[derive(Debug, Clone, Copy)]
enum Fault {
    Sever,
    Cut,
}

impl ChaosProxy {
    pub async fn start(upstream_port: u16) -> ChaosProxy {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = cut.clone();
        let links: Links = Arc::default();
        let trip: Arc<std::sync::Mutex<Option<(usize, Fault)>>> = Arc::default();
        let (open, armed) = (links.clone(), trip.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let flag = flag.clone();
                let flag_after = flag.clone();
                let (all, armed) = (open.clone(), armed.clone());
                // After `n` more bytes from the database: the armed fault, if any.
                let passed = move |n: usize| {
                    let mut trip = armed.lock().unwrap();
                    let Some((left, fault)) = trip.as_mut() else {
                        return;
                    };
                    if n < *left {
                        *left -= n;
                        return;
                    }
                    match *fault {
                        Fault::Cut => flag_after.store(true, Ordering::SeqCst),
                        Fault::Sever => {
                            for link in all.lock().unwrap().drain(..) {
                                link.abort();
                            }
                        }
                    }
                    *trip = None;
                };
                let link = tokio::spawn(async move {
                    let Ok(server) =
                        tokio::net::TcpStream::connect(("127.0.0.1", upstream_port)).await
                    else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let pump =
                        |mut from: tokio::net::tcp::OwnedReadHalf,
                         mut to: tokio::net::tcp::OwnedWriteHalf,
                         flag: Arc<std::sync::atomic::AtomicBool>,
                         passed: Option<Arc<dyn Fn(usize) + Send + Sync>>| async move {
                            let mut buf = vec![0u8; 16 * 1024];
                            loop {
                                let n = match from.read(&mut buf).await {
                                    Ok(0) | Err(_) => return,
                                    Ok(n) => n,
                                };
                                if let Some(passed) = &passed {
                                    passed(n);
                                }
                                // While cut, hold the bytes (and so stop reading: TCP
                                // pushes back) until healed, as a partition does: nothing
                                // is lost, the peer just hears nothing meanwhile.
                                while flag.load(Ordering::SeqCst) {
                                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                                }
                                if to.write_all(&buf[..n]).await.is_err() {
                                    return;
                                }
                            }
                        };
                    // Both directions in this task, so aborting it closes both sockets.
                    tokio::join!(
                        pump(cr, sw, flag.clone(), None),
                        pump(sr, cw, flag, Some(Arc::new(passed)))
                    );
                });
                open.lock().unwrap().push(link.abort_handle());
            }
        });
        ChaosProxy {
            port,
            cut,
            task,
            links,
            trip,
        }
    }

    /// Severs every open connection once the database has sent `bytes` more through the proxy.
    pub fn sever_after(&self, bytes: usize) {
        *self.trip.lock().unwrap() = Some((bytes, Fault::Sever));
    }

    /// Cuts (see [`ChaosProxy::cut`]) once the database has sent `bytes` more through the
    /// proxy.
    pub fn cut_after(&self, bytes: usize) {
        *self.trip.lock().unwrap() = Some((bytes, Fault::Cut));
    }

    /// Closes every open connection at once (the peer sees the socket close, as when a
    /// server or a link dies); new connections are served as before.
    pub fn sever(&self) {
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }

    pub fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn heal(&self) {
        self.cut.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for ChaosProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
