// What the page keeps in this browser (localStorage, under one prefix): the conversations, the
// settings and the API key. Nothing of it is sent anywhere but in the page's own requests.

const PREFIX = "ninfer.";

export function load(name, fallback) {
  try {
    const text = localStorage.getItem(PREFIX + name);
    return text === null ? fallback : JSON.parse(text);
  } catch {
    return fallback;
  }
}

// False when the browser refused (storage full or disabled): the caller tells the user.
export function save(name, value) {
  try {
    localStorage.setItem(PREFIX + name, JSON.stringify(value));
    return true;
  } catch {
    return false;
  }
}

export function remove(name) {
  localStorage.removeItem(PREFIX + name);
}
