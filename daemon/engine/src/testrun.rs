//! Embedded tests (`given` → `expect`, with `$meta` assertions), dry runs and their result
//! shapes. Each case runs in a fresh throwaway model; nothing here touches a registry.

use crate::Timestamp;
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::{Map, Value as Json};

use super::{compile_cached, CreateError, EngineLimits, Model, MutationError};
use valem_core::expr::path::Address;
use valem_core::spec::{MetaProp, ModelSpec, TestCase};

/// One failed expectation.
#[derive(Clone, Debug, PartialEq, Serialize, JsonSchema)]
pub struct Failure {
    /// The asserted address (`$` when the case could not run).
    pub path: String,
    pub expected: Json,
    pub actual: Json,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, JsonSchema)]
pub struct CaseResult {
    pub description: String,
    pub passed: bool,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<Failure>,
}

/// The `test_spec` result shape.
#[derive(Clone, Debug, PartialEq, Serialize, JsonSchema)]
pub struct TestReport {
    pub total: usize,
    pub passed: usize,
    pub failed: usize,
    pub results: Vec<CaseResult>,
}

/// Numbers within this relative tolerance are equal in test expectations (floating-point
/// arithmetic makes `0.1 + 0.2` differ from `0.3` in the last bit).
const REL_TOLERANCE: f64 = 1e-9;

/// JSON equality with numeric tolerance; object key order is ignored.
pub fn json_matches(expected: &Json, actual: &Json) -> bool {
    match (expected, actual) {
        (Json::Number(a), Json::Number(b)) => {
            let (a, b) = (
                a.as_f64().unwrap_or(f64::NAN),
                b.as_f64().unwrap_or(f64::NAN),
            );
            a == b || (a - b).abs() <= REL_TOLERANCE * a.abs().max(b.abs()).max(1.0)
        }
        (Json::Array(a), Json::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| json_matches(x, y))
        }
        (Json::Object(a), Json::Object(b)) => {
            a.len() == b.len()
                && a.iter()
                    .all(|(k, v)| b.get(k).is_some_and(|w| json_matches(v, w)))
        }
        _ => expected == actual,
    }
}

/// Run `tests` (or the spec's embedded tests) against fresh instances of `spec`.
pub fn run_tests(
    spec: &ModelSpec,
    tests: Option<&[TestCase]>,
    now: Timestamp,
    limits: &EngineLimits,
) -> Result<TestReport, CreateError> {
    let compiled = compile_cached(spec, limits).map_err(CreateError::Compile)?;
    let cases = tests.unwrap_or(&spec.tests);
    let mut results = Vec::with_capacity(cases.len());
    for (i, case) in cases.iter().enumerate() {
        let description = case
            .description
            .clone()
            .unwrap_or_else(|| format!("test #{}", i + 1));
        let failures = match Model::from_compiled(compiled.clone(), now, limits.clone()) {
            Err(e) => vec![Failure {
                path: "$".into(),
                expected: Json::Null,
                actual: Json::Null,
                message: format!("the model could not be created: {e}"),
            }],
            Ok((mut model, _)) => run_case(&mut model, case, now),
        };
        results.push(CaseResult {
            description,
            passed: failures.is_empty(),
            failures,
        });
    }
    let passed = results.iter().filter(|r| r.passed).count();
    Ok(TestReport {
        total: results.len(),
        passed,
        failed: results.len() - passed,
        results,
    })
}

fn run_case(model: &mut Model, case: &TestCase, now: Timestamp) -> Vec<Failure> {
    let given: Vec<(String, Json)> = case
        .given
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if let Err(e) = model.mutate(&given, now) {
        return vec![Failure {
            path: "$".into(),
            expected: Json::Null,
            actual: e.to_json(),
            message: format!("`given` was refused: {e}"),
        }];
    }
    let mut failures = Vec::new();
    for (path, expected) in &case.expect {
        let segs = match Address::parse(path).map(|a| a.concrete()) {
            Ok(Some(s)) => s,
            Ok(None) => {
                failures.push(Failure {
                    path: path.clone(),
                    expected: expected.clone(),
                    actual: Json::Null,
                    message: "expectation addresses must be concrete (no `[*]`)".into(),
                });
                continue;
            }
            Err(e) => {
                failures.push(Failure {
                    path: path.clone(),
                    expected: expected.clone(),
                    actual: Json::Null,
                    message: e.message,
                });
                continue;
            }
        };
        if let Some(meta) = expected
            .as_object()
            .and_then(|o| (o.len() == 1).then(|| o.get("$meta")).flatten())
        {
            let Some(meta) = meta.as_object() else {
                failures.push(Failure {
                    path: path.clone(),
                    expected: expected.clone(),
                    actual: Json::Null,
                    message: "`$meta` must be an object of meta properties".into(),
                });
                continue;
            };
            model.materialize(now);
            for (prop, want) in meta {
                let Some(p) = MetaProp::parse_any(prop) else {
                    failures.push(Failure {
                        path: format!("{path}#{prop}"),
                        expected: want.clone(),
                        actual: Json::Null,
                        message: format!("unknown meta property `{prop}`"),
                    });
                    continue;
                };
                let actual = model.meta_value(&segs, p).unwrap_or(Json::Null);
                if !json_matches(want, &actual) {
                    failures.push(Failure {
                        path: format!("{path}#{}", p.name()),
                        expected: want.clone(),
                        actual: actual.clone(),
                        message: format!(
                            "meta {} of {path}: expected {want}, got {actual}",
                            p.name()
                        ),
                    });
                }
            }
            continue;
        }
        let actual = model.get(&segs, now).unwrap_or(Json::Null);
        if !json_matches(expected, &actual) {
            failures.push(Failure {
                path: path.clone(),
                expected: expected.clone(),
                actual: actual.clone(),
                message: format!("{path}: expected {expected}, got {actual}"),
            });
        }
    }
    failures
}

/// One case of the verification report.
#[derive(Clone, Debug, PartialEq, Serialize, JsonSchema)]
pub struct VerificationCase {
    pub description: String,
    /// `passed`, `failed`, or `unverifiable` (the case expects nothing, so nothing can be
    /// checked automatically).
    pub status: &'static str,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<Failure>,
}

/// The trust report of a spec's embedded tests: internal consistency on example inputs, not
/// factual correctness.
#[derive(Clone, Debug, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Verification {
    /// `green`: every checkable case passed; `amber`: at least one failed; `neutral`: no
    /// checkable case.
    pub state: &'static str,
    pub checked_count: usize,
    pub passed_count: usize,
    pub unverifiable_count: usize,
    pub cases: Vec<VerificationCase>,
}

/// Run the spec's embedded tests as a verification report.
pub fn verify(
    spec: &ModelSpec,
    now: Timestamp,
    limits: &EngineLimits,
) -> Result<Verification, CreateError> {
    let checkable: Vec<TestCase> = spec
        .tests
        .iter()
        .filter(|t| !t.expect.is_empty())
        .cloned()
        .collect();
    let mut results = run_tests(spec, Some(&checkable), now, limits)?
        .results
        .into_iter();
    let cases: Vec<VerificationCase> = spec
        .tests
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let description = t
                .description
                .clone()
                .unwrap_or_else(|| format!("test #{}", i + 1));
            let result = if t.expect.is_empty() {
                None
            } else {
                results.next()
            };
            match result {
                Some(r) => VerificationCase {
                    description,
                    status: if r.passed { "passed" } else { "failed" },
                    failures: r.failures,
                },
                None => VerificationCase {
                    description,
                    status: "unverifiable",
                    failures: Vec::new(),
                },
            }
        })
        .collect();
    let count = |s: &str| cases.iter().filter(|c| c.status == s).count();
    let (passed, failed, unverifiable) = (count("passed"), count("failed"), count("unverifiable"));
    let state = if passed + failed == 0 {
        "neutral"
    } else if failed == 0 {
        "green"
    } else {
        "amber"
    };
    Ok(Verification {
        state,
        checked_count: passed + failed,
        passed_count: passed,
        unverifiable_count: unverifiable,
        cases,
    })
}

/// Why a dry run stopped.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DryRunError {
    #[error(transparent)]
    Create(#[from] CreateError),
    #[error("mutation #{index} was refused: {error}")]
    Mutation { index: usize, error: MutationError },
}

/// Compile `spec` in a throwaway model, apply each batch of mutations in order, and return the
/// merged state.
pub fn dry_run(
    spec: &ModelSpec,
    batches: &[Vec<(String, Json)>],
    now: Timestamp,
    limits: &EngineLimits,
) -> Result<Json, DryRunError> {
    let (mut model, _) = Model::create(spec, now, limits.clone())?;
    for (index, batch) in batches.iter().enumerate() {
        model
            .mutate(batch, now)
            .map_err(|error| DryRunError::Mutation { index, error })?;
    }
    Ok(model.merged_json(now))
}

/// Mutation batches that are not one `{"$.path": value}` map or an array of them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchesError {
    #[error("mutation batch #{0} is not an object of `\"$.path\": value` pairs")]
    NotAnObject(usize),
    #[error(
        "mutations must be an object of `\"$.path\": value` pairs, or an array of such objects"
    )]
    WrongShape,
}

/// Read mutation batches: one `{"$.path": value}` map, or an array of them.
pub fn parse_batches(j: &Json) -> Result<Vec<Vec<(String, Json)>>, BatchesError> {
    let one = |m: &Map<String, Json>| {
        m.iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<Vec<_>>()
    };
    match j {
        Json::Object(m) => Ok(vec![one(m)]),
        Json::Array(a) => a
            .iter()
            .enumerate()
            .map(|(i, x)| match x {
                Json::Object(m) => Ok(one(m)),
                _ => Err(BatchesError::NotAnObject(i)),
            })
            .collect(),
        _ => Err(BatchesError::WrongShape),
    }
}
