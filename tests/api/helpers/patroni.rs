//! A stand-in for Patroni's REST API.

use std::sync::{Arc, Mutex};

/// A stand-in for Patroni's REST API that says whatever the test wants: `/cluster` and
/// `/history` answer the current `body`, `/history` with no switches.
pub struct FakePatroni {
    pub url: String,
    cluster: Arc<Mutex<String>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakePatroni {
    pub async fn start(cluster: String) -> FakePatroni {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let body = Arc::new(Mutex::new(cluster));
        let shared = body.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let shared = shared.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let n = sock.read(&mut buf).await.unwrap_or(0);
                    let request = String::from_utf8_lossy(&buf[..n]);
                    let body = if request.starts_with("GET /history") {
                        "[]".to_string()
                    } else {
                        shared.lock().unwrap().clone()
                    };
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = sock.write_all(answer.as_bytes()).await;
                });
            }
        });
        FakePatroni {
            url,
            cluster: body,
            task,
        }
    }

    pub fn say(&self, cluster: String) {
        *self.cluster.lock().unwrap() = cluster;
    }
}

impl Drop for FakePatroni {
    fn drop(&mut self) {
        self.task.abort();
    }
}
