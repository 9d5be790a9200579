//! `timer` effects: scheduled, fired on the timer thread, and their fire time computed.

use super::*;

/// When a timer request fires: `at` (epoch ms or ISO-8601) or `afterMs` after `now`.
pub(super) fn fire_time(req: &EffectRequest, now: Timestamp) -> Result<Timestamp, String> {
    if let Some(at) = &req.at {
        return match at {
            Json::Number(n) => n
                .as_f64()
                .map(|f| Timestamp::from_ms(f as i64))
                .ok_or_else(|| "`at` is not a time".into()),
            Json::String(s) => chrono::DateTime::parse_from_rfc3339(s)
                .map(|t| Timestamp::from_ms(t.timestamp_millis()))
                .or_else(|_| {
                    s.trim()
                        .parse::<f64>()
                        .map(|f| Timestamp::from_ms(f as i64))
                })
                .map_err(|_| format!("`at` is neither epoch ms nor ISO-8601: {s:?}")),
            other => Err(format!("`at` is neither epoch ms nor ISO-8601: {other}")),
        };
    }
    if let Some(after) = &req.after_ms {
        let ms = match after {
            Json::Number(n) => n.as_f64(),
            Json::String(s) => s.trim().parse::<f64>().ok(),
            _ => None,
        }
        .filter(|f| f.is_finite() && *f >= 0.0)
        .ok_or_else(|| format!("`afterMs` is not a delay in milliseconds: {after}"))?;
        return Ok(Timestamp::from_ms(now.ms().saturating_add(ms as i64)));
    }
    Err("a timer effect needs `at` or `afterMs`".into())
}

impl Runner {
    // --- timers ---------------------------------------------------------------------------

    pub(super) fn schedule(&self, t: Timer) {
        if let Ok(mut ts) = self.timers.lock() {
            ts.push(t);
        }
        self.wake.notify_all();
    }

    pub(super) fn timer_loop(self: &Arc<Self>) {
        loop {
            let due = {
                let mut ts = self.timers.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if self.svc.strong_count() == 0 {
                        return;
                    }
                    let now = now();
                    if let Some(i) = ts.iter().position(|t| t.fire_at <= now) {
                        break ts.swap_remove(i);
                    }
                    let next = ts.iter().map(|t| t.fire_at).min();
                    let wait = next.map_or(Duration::from_secs(1), |n| {
                        Duration::from_millis((n.ms() - now.ms()).clamp(1, 1000) as u64)
                    });
                    ts = self
                        .wake
                        .wait_timeout(ts, wait)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|p| p.into_inner().0);
                }
            };
            self.fire(&due);
        }
    }

    pub(super) fn fire(&self, t: &Timer) {
        let Some(svc) = self.service() else { return };
        let Ok(spec) = svc.spec(&crate::ModelId::from(&t.model)).wait() else {
            return;
        };
        let Some(e) = spec.effects.iter().find(|e| e.id == t.req.effect_id) else {
            return;
        };
        let limits = &svc.limits().engine.expr;
        let still = model_input(&svc, &t.model, &spec)
            .ok()
            .and_then(|(input, env)| eval(&e.trigger, &input, &env, limits).ok());
        let holds = matches!(still, Some(Some(ref v)) if trigger_holds(v));
        let r = if holds {
            let job = Job {
                svc: &svc,
                model: &t.model,
                spec: &spec,
                effect: e,
                req: &t.req,
            };
            self.apply(&job, None, 0)
        } else {
            self.set_status(
                &t.model,
                &t.req,
                status(
                    "cancelled",
                    &t.req.dedupe_key,
                    &[("error", json!("the trigger no longer holds"))],
                ),
            )
        };
        self.report(&t.model, &t.req, r);
    }
}
