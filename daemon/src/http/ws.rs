//! The WebSocket `/models/{id}/subscribe` of the reference: one frame per committed change.

use axum::Router;

use super::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
}
