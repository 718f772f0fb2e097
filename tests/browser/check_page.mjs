// Drive the try-it page in Debian's headless Chromium: upload one image, wait for its
// result, print what the page shows as JSON on stdout, save a screenshot.
// Usage: node check_page.mjs URL IMAGE SCREENSHOT   (run by tests/serve/test_page.py)
import { chromium } from "playwright-core";

const [url, image, screenshot] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  // The flags this machine needs: no sandbox as root, no GPU, and no background
  // networking (a closed network refuses those connections).
  args: [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
  ],
});
try {
  const page = await browser.newPage({ viewport: { width: 1200, height: 820 } });
  const consoleErrors = [];
  page.on("console", (m) => { if (m.type() === "error") consoleErrors.push(m.text()); });
  page.on("pageerror", (e) => consoleErrors.push(String(e)));
  await page.goto(url);
  await page.waitForSelector("#load [data-rank]", { timeout: 30000 });
  const ranksShown = await page.$$eval("#load [data-rank]", (els) => els.map((e) => Number(e.dataset.rank)));
  const firstUpdate = await page.$eval("#load", (e) => Number(e.dataset.updated));
  await page.setInputFiles("#files", image);
  await page.waitForSelector('.result[data-state="done"], .result[data-state="error"]', { timeout: 120000 });
  const shown = await page.$eval(".result", (card) => {
    const fields = {};
    for (const dd of card.querySelectorAll("dd[data-field]")) fields[dd.dataset.field] = dd.textContent;
    const canvas = card.querySelector("canvas");
    const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
    const colors = new Set();
    for (let i = 0; i < data.length; i += 4) colors.add(`${data[i]},${data[i + 1]},${data[i + 2]}`);
    const box = canvas.getBoundingClientRect();
    return {
      state: card.dataset.state, fields, title: card.querySelector("h3").textContent,
      canvas: { width: canvas.width, height: canvas.height, colors: colors.size,
                shownWidth: box.width, shownHeight: box.height },
    };
  });
  await page.waitForFunction((t) => Number(document.querySelector("#load").dataset.updated) > t,
                             firstUpdate, { timeout: 5000 });
  // The model line comes from GET /v1/info, which asks every rank (and the hand-off
  // registry) with a 10 s bound each: on a loaded machine it can land after the result.
  await page.waitForFunction(() => document.querySelector("#model").textContent !== "connecting...",
                             null, { timeout: 60000 });
  await page.screenshot({ path: screenshot, fullPage: true });
  console.log(JSON.stringify({ ...shown, ranksShown, consoleErrors, model: await page.textContent("#model") }));
} finally {
  await browser.close();
}
