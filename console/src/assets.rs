//! The stylesheet and the script, compiled into the binary: the console
//! loads nothing from elsewhere (its CSP allows only itself).

use axum::http::header;
use axum::response::IntoResponse;

const CSS: &str = include_str!("assets/console.css");
const JS: &str = include_str!("assets/console.js");

pub(crate) async fn css() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        CSS,
    )
}

pub(crate) async fn js() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        JS,
    )
}
