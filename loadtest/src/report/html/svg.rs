//! Drawing a line chart as inline SVG: a plot area with nice ticks, one path and legend
//! entry per series, an optional dashed marker; and escaping text for HTML.

use std::fmt::Write as _;

const W: f64 = 820.0;
const H: f64 = 260.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 34.0;
const BOTTOM: f64 = 40.0;

/// One line on a chart; x in seconds.
pub struct Series {
    pub name: String,
    pub color: String,
    pub points: Vec<(f64, f64)>,
    /// Draw as a step function (value holds until the next point).
    pub step: bool,
    pub dashed: bool,
}

pub(super) fn series(name: &str, color: &str, points: Vec<(f64, f64)>) -> Series {
    Series {
        name: name.into(),
        color: color.into(),
        points,
        step: false,
        dashed: false,
    }
}

/// A step of 1, 2 or 5 × 10^k giving about five ticks up to `max`.
pub fn nice_step(max: f64) -> f64 {
    if max <= 0.0 || !max.is_finite() {
        return 1.0;
    }
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let nice = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

fn fmt_tick(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Where a chart's plot area sits and how values map onto it.
struct Plot {
    /// Plot area width and height.
    pw: f64,
    ph: f64,
    x_max: f64,
    x_step: f64,
    y_max: f64,
    y_step: f64,
}

impl Plot {
    /// Room for `series`: x from 0 to `x_max`, y from 0 to a nice maximum above the data.
    fn fit(series: &[Series], x_max: f64) -> Self {
        let y_data = series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .fold(0.0f64, f64::max);
        let y_top = y_data.max(1.0);
        let y_step = nice_step(y_top);
        Self {
            pw: W - LEFT - RIGHT,
            ph: H - TOP - BOTTOM,
            x_max,
            x_step: nice_step(x_max),
            y_max: (y_top / y_step).ceil() * y_step,
            y_step,
        }
    }

    fn sx(&self, x: f64) -> f64 {
        LEFT + (x / self.x_max).clamp(0.0, 1.0) * self.pw
    }

    fn sy(&self, y: f64) -> f64 {
        TOP + self.ph - (y / self.y_max).clamp(0.0, 1.0) * self.ph
    }
}

/// An SVG line chart: x in seconds from 0 to `x_max`, y from 0 to a nice maximum.
pub fn chart(
    title: &str,
    y_label: &str,
    series: &[Series],
    x_max: f64,
    marker_x: Option<f64>,
) -> String {
    let p = Plot::fit(series, x_max);
    let mut o = String::new();
    let _ = write!(
        o,
        r#"<svg width="{W}" height="{H}" viewBox="0 0 {W} {H}" xmlns="http://www.w3.org/2000/svg" role="img">"#
    );
    let _ = write!(
        o,
        r#"<text class="title" x="{LEFT}" y="18">{}</text>"#,
        esc(title)
    );
    axes(&mut o, &p, y_label);
    if let Some(mx) = marker_x {
        let px = p.sx(mx);
        let _ = write!(
            o,
            r##"<line x1="{px:.1}" x2="{px:.1}" y1="{TOP}" y2="{:.1}" stroke="#000" stroke-dasharray="4 3"/><text x="{:.1}" y="{:.1}">sold out</text>"##,
            TOP + p.ph,
            px + 3.0,
            TOP + 12.0
        );
    }
    for (i, s) in series.iter().enumerate() {
        line(&mut o, &p, i, s);
    }
    o.push_str("</svg>\n");
    o
}

/// The grid with y ticks, the x ticks, the frame and the axis labels.
fn axes(o: &mut String, p: &Plot, y_label: &str) {
    let (pw, ph) = (p.pw, p.ph);
    let mut y = 0.0;
    while y <= p.y_max + p.y_step / 2.0 {
        let py = p.sy(y);
        let _ = write!(
            o,
            r##"<line x1="{LEFT}" x2="{:.1}" y1="{py:.1}" y2="{py:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            py + 4.0,
            fmt_tick(y)
        );
        y += p.y_step;
    }
    let mut x = 0.0;
    while x <= p.x_max + 1e-9 {
        let px = p.sx(x);
        let _ = write!(
            o,
            r##"<line x1="{px:.1}" x2="{px:.1}" y1="{:.1}" y2="{:.1}" stroke="#999"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP + ph,
            TOP + ph + 4.0,
            TOP + ph + 16.0,
            fmt_tick(x)
        );
        x += p.x_step;
    }
    let _ = write!(
        o,
        r##"<rect x="{LEFT}" y="{TOP}" width="{pw:.1}" height="{ph:.1}" fill="none" stroke="#999"/><text x="{:.1}" y="{:.1}" text-anchor="middle">seconds since start</text><text x="14" y="{:.1}" transform="rotate(-90 14 {:.1})" text-anchor="middle">{}</text>"##,
        LEFT + pw / 2.0,
        H - 6.0,
        TOP + ph / 2.0,
        TOP + ph / 2.0,
        esc(y_label)
    );
}

/// One series: its path (a dot when it has one point) and its legend entry, `i`th down.
fn line(o: &mut String, p: &Plot, i: usize, s: &Series) {
    let mut d = String::new();
    let mut prev: Option<(f64, f64)> = None;
    for &(x, y) in &s.points {
        let (px, py) = (p.sx(x), p.sy(y));
        let _ = match prev {
            None => write!(d, "M{px:.1},{py:.1}"),
            Some((_, ppy)) if s.step => write!(d, " L{px:.1},{ppy:.1} L{px:.1},{py:.1}"),
            Some(_) => write!(d, " L{px:.1},{py:.1}"),
        };
        prev = Some((px, py));
    }
    let dash = if s.dashed {
        r#" stroke-dasharray="6 4""#
    } else {
        ""
    };
    let _ = write!(
        o,
        r#"<path d="{d}" fill="none" stroke="{}" stroke-width="1.6"{dash}/>"#,
        s.color
    );
    if s.points.len() == 1 {
        let (px, py) = (p.sx(s.points[0].0), p.sy(s.points[0].1));
        let _ = write!(
            o,
            r#"<circle cx="{px:.1}" cy="{py:.1}" r="2.5" fill="{}"/>"#,
            s.color
        );
    }
    let ly = TOP + 10.0 + i as f64 * 16.0;
    let lx = LEFT + p.pw + 12.0;
    let _ = write!(
        o,
        r#"<line x1="{lx:.1}" x2="{:.1}" y1="{ly:.1}" y2="{ly:.1}" stroke="{}" stroke-width="3"{dash}/><text x="{:.1}" y="{:.1}">{}</text>"#,
        lx + 18.0,
        s.color,
        lx + 24.0,
        ly + 4.0,
        esc(&s.name)
    );
}

/// Escapes text for HTML element content and attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_drop_trailing_zeros() {
        assert_eq!(fmt_tick(0.0), "0");
        assert_eq!(fmt_tick(0.2), "0.2");
        assert_eq!(fmt_tick(0.25), "0.25");
        assert_eq!(fmt_tick(150.0), "150");
    }

    #[test]
    fn nice_steps() {
        assert_eq!(nice_step(60.0), 20.0);
        assert_eq!(nice_step(1.0), 0.2);
        assert_eq!(nice_step(9.0), 2.0);
        assert_eq!(nice_step(0.0), 1.0);
    }

    #[test]
    fn charts_are_svg_with_escaped_labels() {
        let s = chart(
            "a < b",
            "ms",
            &[series("p50 & co", "#000", vec![(0.0, 1.0), (1.0, 2.0)])],
            1.0,
            Some(0.5),
        );
        assert!(s.starts_with("<svg"));
        assert!(s.contains("a &lt; b"));
        assert!(s.contains("p50 &amp; co"));
        assert!(s.contains("sold out"));
        assert!(!s.contains("NaN"));
    }
}
