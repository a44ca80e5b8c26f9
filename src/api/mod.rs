//! The HTTP surface. Each resource module owns its handlers; `router` merges
//! them into one axum `Router` and derives the OpenAPI document from the same
//! handler annotations, so the contract cannot drift from the code.

mod admin;
mod extract;
mod messages;
mod openapi;
mod ops;
mod problems;
mod protect;
pub mod schema;
mod transcript;
mod users;

pub use openapi::openapi_json;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::Router;
use tower::ServiceBuilder;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::request_id::{PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::timeout::TimeoutLayer;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use utoipa_swagger_ui::SwaggerUi;

use crate::auth::{self, Access};
use crate::config::Limits;
use crate::store::Store;
use crate::telemetry;

/// What every handler may use: the store, the limits from configuration,
/// and who may call.
#[derive(Clone)]
pub struct AppState {
    pub store: Arc<dyn Store>,
    pub limits: Limits,
    pub access: Arc<Access>,
}

impl AppState {
    /// A service with no API keys: everything acts for the default tenant.
    pub fn open(store: Arc<dyn Store>, limits: Limits) -> Self {
        Self {
            store,
            limits,
            access: Arc::new(Access::open()),
        }
    }
}

fn api_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(openapi::header())
        .routes(routes!(messages::append_messages, messages::get_history))
        .routes(routes!(messages::get_message, messages::delete_message))
        .routes(routes!(
            transcript::get_transcript,
            transcript::put_transcript
        ))
        .routes(routes!(admin::purge_expired))
        .routes(routes!(admin::clear_all))
        .routes(routes!(users::list_users))
        .routes(routes!(
            users::user_stats,
            users::user_exists,
            users::clear_user
        ))
        .routes(routes!(ops::healthz))
        .routes(routes!(ops::readyz))
        .routes(routes!(ops::openapi_document))
        .routes(routes!(ops::metrics))
}

/// The whole service as one axum `Router`: the seam tests drive.
///
/// Each route's layers go on as one stack in one `layer` call: every call
/// of `Router::layer` boxes each route anew, and a boxed route is cloned,
/// with all it wraps, on every request.
pub fn router(state: AppState) -> Router {
    telemetry::metrics();
    let (routes, _) = api_routes().split_for_parts();
    let limits = state.limits;
    let guards = Guards {
        access: state.access.clone(),
        budgets: Arc::new(protect::Budgets::new(&limits)),
    };
    let routes = routes
        .layer(
            ServiceBuilder::new()
                .layer(telemetry::trace_requests())
                .layer(middleware::from_fn_with_state(guards, guard))
                .layer(TimeoutLayer::with_status_code(
                    StatusCode::SERVICE_UNAVAILABLE,
                    limits.request_timeout,
                ))
                .layer(DefaultBodyLimit::max(limits.max_body_bytes))
                .layer(CatchPanicLayer::custom(protect::panic_response)),
        )
        .with_state(state);
    outer_layers(Router::new().merge(docs()).fallback_service(routes))
}

/// What a request passes before its handler, shared by every request.
#[derive(Clone)]
struct Guards {
    access: Arc<Access>,
    budgets: Arc<protect::Budgets>,
}

/// Counts and times every routed request, whatever its answer; sheds it
/// when the server's budgets are full (503), then checks its key (401, 403,
/// 429), and holds a large answer in the budgets until it is sent. One
/// middleware rather than three: each costs a boxed service and future per
/// request.
async fn guard(State(guards): State<Guards>, mut request: Request, next: Next) -> Response {
    let timer = telemetry::RequestTimer::start(&request);
    let response = match guards.budgets.admit(&request) {
        Err(busy) => *busy,
        // Held until the request is answered.
        Ok(admitted) => match auth::authorize(&guards.access, &mut request) {
            Err(refused) => *refused,
            Ok(()) => admitted.hold_answer(next.run(request).await).await,
        },
    };
    timer.finish(&response);
    response
}

/// What wraps every answer, whatever made it: problem+json bodies for bare
/// errors (wrapped from outside so that it sees responses axum finishes
/// last, such as a 405 with its `Allow` header), a 500 for a panic anywhere
/// inside, and the request id, set before anything logs and returned on
/// every response. Public so that a test can wrap a handler of its own.
pub fn outer_layers(router: Router) -> Router {
    router.layer(
        ServiceBuilder::new()
            .layer(SetRequestIdLayer::x_request_id(telemetry::RequestIds::new()))
            .layer(PropagateRequestIdLayer::x_request_id())
            .layer(middleware::from_fn(problems::problem_for_bare_errors))
            .layer(CatchPanicLayer::custom(protect::panic_response)),
    )
}

/// `/docs`: Swagger UI on `/openapi.json`, its assets compiled into the
/// binary (the crate's vendored copy: nothing is fetched at build or run time).
fn docs() -> Router {
    SwaggerUi::new("/docs")
        .config(
            utoipa_swagger_ui::Config::new(["/openapi.json"])
                // No badge that asks validator.swagger.io about the document.
                .validator_url("none")
                .try_it_out_enabled(true)
                .persist_authorization(true),
        )
        .into()
}
